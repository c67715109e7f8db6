# A regional checkpoint bucket next to the GPUs: persistent runs under runs/,
# throwaway runs under scratch/ deleted after 3 days, run checkpoints moved to
# NEARLINE after 60 days, a trainer service account usable from GKE pods via
# Workload Identity, and read-only access for researchers.
module "checkpoints" {
  source = "../../modules/gcs-checkpoint-bucket"

  project_id  = var.project_id
  bucket_name = var.bucket_name
  location    = var.region

  run_prefix                = "runs"
  ephemeral_prefix          = "scratch"
  ephemeral_expiration_days = 3

  abort_incomplete_multipart_days = 3
  transition_days                 = 60
  transition_storage_class        = "NEARLINE"

  versioning_enabled         = false
  soft_delete_retention_days = 0

  trainer_service_account_id = "ckpt-trainer"
  trainer_workload_identity_members = [
    "serviceAccount:${var.project_id}.svc.id.goog[${var.gke_namespace}/${var.gke_service_account}]",
  ]
  reader_members = var.reader_members

  labels = {
    team = "ml-platform"
  }
}
