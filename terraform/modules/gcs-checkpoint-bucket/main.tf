locals {
  # Object-name prefixes (with trailing slash) that trainers write and readers
  # read. The trailing slash keeps "runs/" from also matching "runs-old/...".
  access_prefixes = concat(
    ["${var.run_prefix}/"],
    var.ephemeral_prefix == null ? [] : ["${var.ephemeral_prefix}/"],
  )

  # Would the ephemeral delete rule reach persistent checkpoints?
  ephemeral_covers_runs = var.ephemeral_prefix != null && (
    var.run_prefix == coalesce(var.ephemeral_prefix, "-") ||
    startswith("${var.run_prefix}/", "${coalesce(var.ephemeral_prefix, "-")}/")
  )

  use_kms = var.kms_key_name != null
}

# The Cloud Storage service agent encrypts and decrypts with a CMEK key on the
# callers' behalf; it needs the key before the bucket can use it.
data "google_storage_project_service_account" "this" {
  count   = local.use_kms && var.grant_kms_to_storage_service_agent ? 1 : 0
  project = var.project_id
}

resource "google_kms_crypto_key_iam_member" "storage_agent" {
  count         = local.use_kms && var.grant_kms_to_storage_service_agent ? 1 : 0
  crypto_key_id = var.kms_key_name
  role          = "roles/cloudkms.cryptoKeyEncrypterDecrypter"
  member        = "serviceAccount:${data.google_storage_project_service_account.this[0].email_address}"
}

resource "google_storage_bucket" "this" {
  #checkov:skip=CKV_GCP_78:Versioning is an option (var.versioning_enabled), off by default: prune/gc delete multi-GB checkpoints often, and noncurrent copies would multiply storage cost. See README "Versioning and soft delete".
  name          = var.bucket_name
  project       = var.project_id
  location      = var.location
  storage_class = "STANDARD"
  force_destroy = var.force_destroy
  labels        = var.labels

  # IAM only (no object ACLs): required for the IAM conditions below.
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  versioning {
    enabled = var.versioning_enabled
  }

  soft_delete_policy {
    retention_duration_seconds = var.soft_delete_retention_days * 86400
  }

  dynamic "encryption" {
    for_each = local.use_kms ? [var.kms_key_name] : []
    content {
      default_kms_key_name = encryption.value
    }
  }

  dynamic "logging" {
    for_each = var.access_log_bucket == null ? [] : [var.access_log_bucket]
    content {
      log_bucket        = logging.value
      log_object_prefix = var.bucket_name
    }
  }

  # Bucket-wide backstop for XML-API multipart uploads that a crash or
  # preemption cut off (this action accepts only the age condition).
  lifecycle_rule {
    action {
      type = "AbortIncompleteMultipartUpload"
    }
    condition {
      age = var.abort_incomplete_multipart_days
    }
  }

  # Old versions: does nothing on a never-versioned bucket, and still cleans
  # up if versioning is turned off later.
  dynamic "lifecycle_rule" {
    for_each = var.noncurrent_version_expiration_days == null ? [] : [var.noncurrent_version_expiration_days]
    content {
      action {
        type = "Delete"
      }
      condition {
        days_since_noncurrent_time = lifecycle_rule.value
        with_state                 = "ARCHIVED"
      }
    }
  }

  dynamic "lifecycle_rule" {
    for_each = var.ephemeral_prefix == null ? [] : [var.ephemeral_prefix]
    content {
      action {
        type = "Delete"
      }
      condition {
        age            = var.ephemeral_expiration_days
        matches_prefix = ["${lifecycle_rule.value}/"]
        with_state     = "ANY"
      }
    }
  }

  dynamic "lifecycle_rule" {
    for_each = var.transition_days == null ? [] : [var.transition_days]
    content {
      action {
        type          = "SetStorageClass"
        storage_class = var.transition_storage_class
      }
      condition {
        age                   = lifecycle_rule.value
        matches_prefix        = ["${var.run_prefix}/"]
        matches_storage_class = ["STANDARD"]
      }
    }
  }

  lifecycle {
    precondition {
      condition     = !local.ephemeral_covers_runs
      error_message = "The ephemeral_prefix must not contain run_prefix: the ephemeral delete rule would delete persistent checkpoints."
    }
  }

  depends_on = [google_kms_crypto_key_iam_member.storage_agent]
}
