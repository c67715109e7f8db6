# Who may do what, limited to local.access_prefixes with IAM conditions:
#   trainers (the service account below, plus var.trainer_members):
#     roles/storage.objectAdmin: save, resume, prune, gc, abort uploads
#   readers (var.reader_members):
#     roles/storage.objectViewer: list, inspect, verify, download
#
# Object-level permissions (get, create, delete) are checked against the
# object's name, so `resource.name.startsWith(...)` limits them to the
# prefixes. Listing (storage.objects.list, storage.multipartUploads.list) is
# checked against the bucket itself, which no object-name condition matches;
# the `resource.type == Bucket` clause lets those bucket-level checks through.
# Net effect: principals can list object names bucket-wide but read, write and
# delete only under the prefixes.

locals {
  object_name_clauses = [
    for p in local.access_prefixes :
    "resource.name.startsWith(\"projects/_/buckets/${google_storage_bucket.this.name}/objects/${p}\")"
  ]

  prefix_condition_expression = join(" || ", concat(
    ["resource.type == \"storage.googleapis.com/Bucket\""],
    local.object_name_clauses,
  ))

  prefix_condition_description = "Objects under ${join(", ", local.access_prefixes)} (and bucket-level listing)"
}

resource "google_service_account" "trainer" {
  count = var.create_trainer_service_account ? 1 : 0

  project      = var.project_id
  account_id   = var.trainer_service_account_id
  display_name = "cloudckpt trainer (${var.bucket_name})"
  description  = "Training jobs writing cloudckpt checkpoints to gs://${var.bucket_name}/${var.run_prefix}"
}

resource "google_storage_bucket_iam_member" "trainer_sa" {
  count = var.create_trainer_service_account ? 1 : 0

  bucket = google_storage_bucket.this.name
  role   = "roles/storage.objectAdmin"
  member = "serviceAccount:${google_service_account.trainer[0].email}"

  condition {
    title       = "checkpoint-prefixes"
    description = local.prefix_condition_description
    expression  = local.prefix_condition_expression
  }
}

resource "google_storage_bucket_iam_member" "trainer" {
  for_each = toset(var.trainer_members)

  bucket = google_storage_bucket.this.name
  role   = "roles/storage.objectAdmin"
  member = each.value

  condition {
    title       = "checkpoint-prefixes"
    description = local.prefix_condition_description
    expression  = local.prefix_condition_expression
  }
}

resource "google_storage_bucket_iam_member" "reader" {
  for_each = toset(var.reader_members)

  bucket = google_storage_bucket.this.name
  role   = "roles/storage.objectViewer"
  member = each.value

  condition {
    title       = "checkpoint-prefixes"
    description = local.prefix_condition_description
    expression  = local.prefix_condition_expression
  }
}

# GKE (or other federated) workloads impersonate the trainer service account.
resource "google_service_account_iam_member" "trainer_workload_identity" {
  for_each = var.create_trainer_service_account ? toset(var.trainer_workload_identity_members) : toset([])

  service_account_id = google_service_account.trainer[0].name
  role               = "roles/iam.workloadIdentityUser"
  member             = each.value
}
