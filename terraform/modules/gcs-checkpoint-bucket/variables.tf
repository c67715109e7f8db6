# ---------------------------------------------------------------------------
# Bucket
# ---------------------------------------------------------------------------

variable "project_id" {
  description = "Project that owns the bucket and the trainer service account."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id)) || can(regex("^[a-z0-9.-]+:[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "The project_id must be a project ID (6-30 lowercase letters, digits and hyphens, starting with a letter), optionally domain-scoped (example.com:my-project)."
  }
}

variable "bucket_name" {
  description = "Name of the bucket to create. 3-63 characters: lowercase letters, digits, hyphens and underscores, starting and ending with a letter or digit. Dotted names are rejected (they need domain verification); names may not start with \"goog\" or contain \"google\"."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9_-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "The bucket_name must be 3-63 characters of lowercase letters, digits, '-' and '_', starting and ending with a letter or digit (dotted, domain-named buckets are not supported by this module)."
  }

  validation {
    condition     = !startswith(var.bucket_name, "goog") && !strcontains(var.bucket_name, "google") && !strcontains(var.bucket_name, "g00gle")
    error_message = "The bucket_name may not start with \"goog\" or contain \"google\" (or look-alikes such as \"g00gle\")."
  }
}

variable "location" {
  description = "Bucket location: a region (e.g. \"us-central1\", best next to the GPUs: no inter-region transfer), a dual-region or a multi-region (e.g. \"US\")."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9-]+$", var.location))
    error_message = "The location must be a region, dual-region or multi-region name such as \"us-central1\" or \"US\"."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete a bucket that still holds objects. Leave false for buckets with checkpoints you care about."
  type        = bool
  default     = false
}

variable "labels" {
  description = "Labels on the bucket."
  type        = map(string)
  default     = {}
}

# ---------------------------------------------------------------------------
# Layout: where checkpoints go inside the bucket
# ---------------------------------------------------------------------------

variable "run_prefix" {
  description = "Object-name prefix (no leading or trailing slash) under which runs keep their checkpoints: a run's save_folder is gs://<bucket>/<run_prefix>/<run-name>. The trainer and reader bindings are limited to this prefix (and ephemeral_prefix)."
  type        = string
  default     = "runs"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._=-]*(/[A-Za-z0-9][A-Za-z0-9._=-]*)*$", var.run_prefix))
    error_message = "The run_prefix must be one or more path segments of letters, digits, '.', '_', '=' or '-' separated by single slashes, each segment starting with a letter or digit, with no leading or trailing slash (e.g. \"runs\" or \"team-a/runs\")."
  }
}

variable "ephemeral_prefix" {
  description = "Optional object-name prefix (no leading or trailing slash) for disposable runs, e.g. \"scratch\". Everything under it is deleted ephemeral_expiration_days after creation. cloudckpt does NOT route ephemeral checkpoints here by itself (the ephemeral flag lives inside each step's .metadata.json): only runs whose whole save_folder points under this prefix are affected. null: no such prefix."
  type        = string
  default     = null

  validation {
    condition     = var.ephemeral_prefix == null || can(regex("^[A-Za-z0-9][A-Za-z0-9._=-]*(/[A-Za-z0-9][A-Za-z0-9._=-]*)*$", coalesce(var.ephemeral_prefix, "x")))
    error_message = "The ephemeral_prefix must be null or path segments of letters, digits, '.', '_', '=' or '-' separated by single slashes, with no leading or trailing slash (e.g. \"scratch\")."
  }
}

# ---------------------------------------------------------------------------
# Protection and encryption
# ---------------------------------------------------------------------------

variable "versioning_enabled" {
  description = "Turn on object versioning. Deleted or overwritten objects are kept as noncurrent versions until noncurrent_version_expiration_days; every checkpoint that cloudckpt prune/gc deletes stays billed that long."
  type        = bool
  default     = false
}

variable "noncurrent_version_expiration_days" {
  description = "Days after becoming noncurrent at which object versions are deleted (only matters with versioning on, or after it was on). null keeps them forever."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days == null || (floor(coalesce(var.noncurrent_version_expiration_days, 1)) == coalesce(var.noncurrent_version_expiration_days, 1) && coalesce(var.noncurrent_version_expiration_days, 1) >= 1 && coalesce(var.noncurrent_version_expiration_days, 1) <= 3650)
    error_message = "The noncurrent_version_expiration_days must be null or a whole number of days from 1 to 3650."
  }
}

variable "soft_delete_retention_days" {
  description = "Soft-delete retention: deleted objects stay restorable (and billed) this many days. 0 turns soft delete off (the default here: checkpoint buckets delete large objects often, see README); otherwise 7 to 90."
  type        = number
  default     = 0

  validation {
    condition     = floor(var.soft_delete_retention_days) == var.soft_delete_retention_days && (var.soft_delete_retention_days == 0 || (var.soft_delete_retention_days >= 7 && var.soft_delete_retention_days <= 90))
    error_message = "The soft_delete_retention_days must be 0 (off) or a whole number of days from 7 to 90."
  }
}

variable "kms_key_name" {
  description = "Cloud KMS key (projects/<p>/locations/<l>/keyRings/<r>/cryptoKeys/<k>) for CMEK default encryption; it must be in the bucket's location. null: Google-managed encryption."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_name == null || can(regex("^projects/[^/]+/locations/[^/]+/keyRings/[^/]+/cryptoKeys/[^/]+$", coalesce(var.kms_key_name, "x")))
    error_message = "The kms_key_name must be null or projects/<project>/locations/<location>/keyRings/<ring>/cryptoKeys/<key>."
  }
}

variable "grant_kms_to_storage_service_agent" {
  description = "With kms_key_name: grant the project's Cloud Storage service agent roles/cloudkms.cryptoKeyEncrypterDecrypter on the key (needed for CMEK; set false if the key's IAM is managed elsewhere)."
  type        = bool
  default     = true
}

variable "access_log_bucket" {
  description = "Name of an existing bucket that receives usage logs for this bucket. null: no usage logs (Cloud Audit Logs still record admin activity)."
  type        = string
  default     = null
}

# ---------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------

variable "abort_incomplete_multipart_days" {
  description = "Abort XML-API multipart uploads still incomplete this many days after they started (bucket-wide). The backstop for uploads cut off by a crash or preemption; `cloudckpt gc` aborts them sooner for runs that resume."
  type        = number
  default     = 3

  validation {
    condition     = floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days && var.abort_incomplete_multipart_days >= 1 && var.abort_incomplete_multipart_days <= 365
    error_message = "The abort_incomplete_multipart_days must be a whole number of days from 1 to 365."
  }
}

variable "ephemeral_expiration_days" {
  description = "Days after creation at which objects under ephemeral_prefix are deleted. Keep it well above the longest pause of a run you may still want to resume."
  type        = number
  default     = 7

  validation {
    condition     = floor(var.ephemeral_expiration_days) == var.ephemeral_expiration_days && var.ephemeral_expiration_days >= 1 && var.ephemeral_expiration_days <= 3650
    error_message = "The ephemeral_expiration_days must be a whole number of days from 1 to 3650."
  }
}

variable "transition_days" {
  description = "Days after creation at which STANDARD objects under run_prefix move to transition_storage_class. null: no transition."
  type        = number
  default     = null

  validation {
    condition     = var.transition_days == null || (floor(coalesce(var.transition_days, 1)) == coalesce(var.transition_days, 1) && coalesce(var.transition_days, 1) >= 1 && coalesce(var.transition_days, 1) <= 3650)
    error_message = "The transition_days must be null or a whole number of days from 1 to 3650."
  }
}

variable "transition_storage_class" {
  description = "Storage class for the run_prefix transition. All GCS classes serve reads immediately, but each has a minimum storage duration (NEARLINE 30, COLDLINE 90, ARCHIVE 365 days) and a per-GB retrieval fee: resuming from, or pruning, a transitioned checkpoint costs extra."
  type        = string
  default     = "NEARLINE"

  validation {
    condition     = contains(["NEARLINE", "COLDLINE", "ARCHIVE"], var.transition_storage_class)
    error_message = "The transition_storage_class must be one of NEARLINE, COLDLINE, ARCHIVE."
  }
}

# ---------------------------------------------------------------------------
# IAM
# ---------------------------------------------------------------------------

variable "create_trainer_service_account" {
  description = "Create a service account for training jobs and grant it roles/storage.objectAdmin on the prefixes."
  type        = bool
  default     = true
}

variable "trainer_service_account_id" {
  description = "account_id of the trainer service account (6-30 characters). Must be unique in the project: change it when one project holds several checkpoint buckets."
  type        = string
  default     = "checkpoint-trainer"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.trainer_service_account_id))
    error_message = "The trainer_service_account_id must be 6-30 characters of lowercase letters, digits and hyphens, starting with a letter and not ending with a hyphen."
  }
}

variable "trainer_workload_identity_members" {
  description = "Principals allowed to act as the trainer service account through Workload Identity, e.g. \"serviceAccount:<project>.svc.id.goog[<namespace>/<ksa>]\" for GKE."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for m in var.trainer_workload_identity_members : can(regex("^(serviceAccount|principal|principalSet):", m))])
    error_message = "Each of trainer_workload_identity_members must start with serviceAccount:, principal: or principalSet:."
  }
}

variable "trainer_members" {
  description = "Additional principals (e.g. \"serviceAccount:...\", \"group:...\") that get the same prefix-limited roles/storage.objectAdmin binding as the trainer service account."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for m in var.trainer_members : can(regex("^(user|group|serviceAccount|domain|principal|principalSet):", m))])
    error_message = "Each of trainer_members must be an IAM member such as \"serviceAccount:x@p.iam.gserviceaccount.com\" or \"group:ml@example.com\" (allUsers / allAuthenticatedUsers are not accepted)."
  }
}

variable "reader_members" {
  description = "Principals that get prefix-limited roles/storage.objectViewer (evaluators, notebooks, `cloudckpt list/verify/download`)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for m in var.reader_members : can(regex("^(user|group|serviceAccount|domain|principal|principalSet):", m))])
    error_message = "Each of reader_members must be an IAM member such as \"group:ml@example.com\" (allUsers / allAuthenticatedUsers are not accepted: public access prevention is enforced)."
  }
}
