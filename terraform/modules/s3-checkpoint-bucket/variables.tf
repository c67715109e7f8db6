# ---------------------------------------------------------------------------
# Bucket
# ---------------------------------------------------------------------------

variable "bucket_name" {
  description = "Name of the bucket to create. 3-63 characters: lowercase letters, digits and hyphens; starts and ends with a letter or digit. Dots are rejected on purpose: they break TLS for virtual-hosted requests (bucket.name.s3.amazonaws.com)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "The bucket_name must be 3-63 characters of lowercase letters, digits and hyphens, starting and ending with a letter or digit (dots are not allowed: they break TLS with virtual-hosted addressing)."
  }

  validation {
    condition = !(
      startswith(var.bucket_name, "xn--") ||
      startswith(var.bucket_name, "sthree-") ||
      startswith(var.bucket_name, "amzn-s3-demo-") ||
      endswith(var.bucket_name, "-s3alias") ||
      endswith(var.bucket_name, "--ol-s3") ||
      endswith(var.bucket_name, "--x-s3") ||
      endswith(var.bucket_name, "--table-s3")
    )
    error_message = "The bucket_name uses a prefix (xn--, sthree-, amzn-s3-demo-) or suffix (-s3alias, --ol-s3, --x-s3, --table-s3) that S3 reserves."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete a bucket that still holds objects. Leave false for buckets with checkpoints you care about."
  type        = bool
  default     = false
}

variable "tags" {
  description = "Tags applied to every resource this module creates."
  type        = map(string)
  default     = {}
}

# ---------------------------------------------------------------------------
# Layout: where checkpoints go inside the bucket
# ---------------------------------------------------------------------------

variable "run_prefix" {
  description = "Key prefix (no leading or trailing slash) under which runs keep their checkpoints: a run's save_folder is s3://<bucket>/<run_prefix>/<run-name>. Trainer and evaluator access is limited to this prefix (and ephemeral_prefix)."
  type        = string
  default     = "runs"

  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._=-]*(/[A-Za-z0-9][A-Za-z0-9._=-]*)*$", var.run_prefix))
    error_message = "The run_prefix must be one or more path segments of letters, digits, '.', '_', '=' or '-' separated by single slashes, each segment starting with a letter or digit, with no leading or trailing slash (e.g. \"runs\" or \"team-a/runs\")."
  }
}

variable "ephemeral_prefix" {
  description = "Optional key prefix (no leading or trailing slash) for disposable runs, e.g. \"scratch\". Everything under it expires after ephemeral_expiration_days. cloudckpt does NOT route ephemeral checkpoints here by itself (the ephemeral flag lives inside each step's .metadata.json): only runs whose whole save_folder points under this prefix are affected. null: no such prefix."
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
  description = "Turn on S3 versioning. Protects against accidental deletes (trainers get s3:DeleteObject but not s3:DeleteObjectVersion), but every checkpoint that cloudckpt prune/gc deletes stays billed as a noncurrent version for noncurrent_version_expiration_days. When false the bucket's versioning state is 'Suspended' (equivalent to never versioned for new objects)."
  type        = bool
  default     = false
}

variable "noncurrent_version_expiration_days" {
  description = "Days after which noncurrent object versions are deleted (only matters with versioning on, or after it was on). null keeps noncurrent versions forever."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days == null || (floor(coalesce(var.noncurrent_version_expiration_days, 1)) == coalesce(var.noncurrent_version_expiration_days, 1) && coalesce(var.noncurrent_version_expiration_days, 1) >= 1 && coalesce(var.noncurrent_version_expiration_days, 1) <= 3650)
    error_message = "The noncurrent_version_expiration_days must be null or a whole number of days from 1 to 3650."
  }
}

variable "kms_key_arn" {
  description = "ARN of a KMS key for SSE-KMS default encryption (with an S3 Bucket Key to keep KMS request costs down). null: SSE-S3 (AES256). With a key, the trainer and evaluator policies also get kms:Decrypt / kms:GenerateDataKey on it."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:(key|alias)/.+$", coalesce(var.kms_key_arn, "x")))
    error_message = "The kms_key_arn must be null or a KMS key ARN (arn:aws:kms:<region>:<account>:key/<id>)."
  }
}

variable "minimum_tls_version" {
  description = "Requests over TLS older than this are denied by the bucket policy (requests without TLS are always denied)."
  type        = string
  default     = "1.2"

  validation {
    condition     = contains(["1.2", "1.3"], var.minimum_tls_version)
    error_message = "The minimum_tls_version must be \"1.2\" or \"1.3\"."
  }
}

variable "additional_bucket_policy_json" {
  description = "Optional extra bucket policy document (JSON) merged into the module's policy, e.g. cross-account grants. Statement Sids must not collide with DenyInsecureTransport / DenyOutdatedTLS."
  type        = string
  default     = null
}

variable "access_log_bucket" {
  description = "Name of an existing bucket that receives S3 server access logs for this bucket. null: no access logging."
  type        = string
  default     = null
}

variable "access_log_prefix" {
  description = "Key prefix for access log objects in access_log_bucket."
  type        = string
  default     = "s3-access-logs/"
}

# ---------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------

variable "abort_incomplete_multipart_days" {
  description = "Abort multipart uploads still incomplete this many days after they started (bucket-wide). This is the backstop for uploads cut off by a crash or preemption; `cloudckpt gc` aborts them sooner (after gc_grace_seconds) for runs that resume."
  type        = number
  default     = 3

  validation {
    condition     = floor(var.abort_incomplete_multipart_days) == var.abort_incomplete_multipart_days && var.abort_incomplete_multipart_days >= 1 && var.abort_incomplete_multipart_days <= 365
    error_message = "The abort_incomplete_multipart_days must be a whole number of days from 1 to 365."
  }
}

variable "ephemeral_expiration_days" {
  description = "Days after creation at which objects under ephemeral_prefix (or carrying ephemeral_tag) expire. Keep it well above the longest pause of a run you may still want to resume."
  type        = number
  default     = 7

  validation {
    condition     = floor(var.ephemeral_expiration_days) == var.ephemeral_expiration_days && var.ephemeral_expiration_days >= 1 && var.ephemeral_expiration_days <= 3650
    error_message = "The ephemeral_expiration_days must be a whole number of days from 1 to 3650."
  }
}

variable "ephemeral_tag" {
  description = "Optional object tag {key, value}; objects carrying it expire after ephemeral_expiration_days. cloudckpt does not tag objects itself: this is for tooling that tags what it writes. null: no tag rule."
  type = object({
    key   = string
    value = string
  })
  default = null
}

variable "transition_days" {
  description = "Days after creation at which objects under run_prefix move to transition_storage_class. null: no transition. STANDARD_IA and ONEZONE_IA need at least 30."
  type        = number
  default     = null

  validation {
    condition     = var.transition_days == null || (floor(coalesce(var.transition_days, 0)) == coalesce(var.transition_days, 0) && coalesce(var.transition_days, 0) >= 0 && coalesce(var.transition_days, 0) <= 3650)
    error_message = "The transition_days must be null or a whole number of days from 0 to 3650."
  }
}

variable "transition_storage_class" {
  description = "Storage class for the run_prefix transition. Only classes that serve reads immediately are allowed: cloudckpt reads markers and shards with plain GETs, which fail on GLACIER / DEEP_ARCHIVE objects until restored."
  type        = string
  default     = "INTELLIGENT_TIERING"

  validation {
    condition     = contains(["STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR"], var.transition_storage_class)
    error_message = "The transition_storage_class must be one of STANDARD_IA, ONEZONE_IA, INTELLIGENT_TIERING, GLACIER_IR (classes readable without a restore)."
  }
}

variable "noncurrent_transition_days" {
  description = "Days after becoming noncurrent at which object versions move to noncurrent_transition_storage_class. null: no transition. Only useful with versioning and a noncurrent_version_expiration_days larger than this."
  type        = number
  default     = null

  validation {
    condition     = var.noncurrent_transition_days == null || (floor(coalesce(var.noncurrent_transition_days, 1)) == coalesce(var.noncurrent_transition_days, 1) && coalesce(var.noncurrent_transition_days, 1) >= 1 && coalesce(var.noncurrent_transition_days, 1) <= 3650)
    error_message = "The noncurrent_transition_days must be null or a whole number of days from 1 to 3650."
  }
}

variable "noncurrent_transition_storage_class" {
  description = "Storage class for noncurrent versions (any transition class: restoring an old version is a manual operation anyway)."
  type        = string
  default     = "GLACIER_IR"

  validation {
    condition     = contains(["STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR", "GLACIER", "DEEP_ARCHIVE"], var.noncurrent_transition_storage_class)
    error_message = "The noncurrent_transition_storage_class must be one of STANDARD_IA, ONEZONE_IA, INTELLIGENT_TIERING, GLACIER_IR, GLACIER, DEEP_ARCHIVE."
  }
}

# ---------------------------------------------------------------------------
# IAM
# ---------------------------------------------------------------------------

variable "create_iam_policies" {
  description = "Create the trainer (read/write/delete on the prefixes) and evaluator (read-only) managed IAM policies. Their JSON is output either way."
  type        = bool
  default     = true
}

variable "iam_name_prefix" {
  description = "Prefix for IAM policy, role and instance profile names. null: the bucket name."
  type        = string
  default     = null

  validation {
    condition     = var.iam_name_prefix == null || can(regex("^[A-Za-z0-9+=,.@_-]{1,40}$", coalesce(var.iam_name_prefix, "x")))
    error_message = "The iam_name_prefix must be null or 1-40 characters of letters, digits and +=,.@_-."
  }
}

variable "iam_path" {
  description = "IAM path for the policies, role and instance profile."
  type        = string
  default     = "/"

  validation {
    condition     = can(regex("^/([\\x21-\\x7E]{0,510}/)?$", var.iam_path))
    error_message = "The iam_path must start and end with '/' (e.g. \"/\" or \"/ml/\")."
  }
}

variable "create_trainer_role" {
  description = "Create an IAM role for training jobs with the trainer policy attached."
  type        = bool
  default     = false
}

variable "trainer_role_assume_role_policy_json" {
  description = "Trust policy (JSON) of the trainer role, e.g. for EKS IRSA / Pod Identity or SageMaker. null: trusted by the services in trainer_role_trusted_services."
  type        = string
  default     = null
}

variable "trainer_role_trusted_services" {
  description = "Service principals that may assume the trainer role when trainer_role_assume_role_policy_json is null."
  type        = list(string)
  default     = ["ec2.amazonaws.com"]

  validation {
    condition     = alltrue([for s in var.trainer_role_trusted_services : can(regex("^[a-z0-9.-]+\\.amazonaws\\.com(\\.cn)?$", s))])
    error_message = "Each of trainer_role_trusted_services must be a service principal such as \"ec2.amazonaws.com\"."
  }
}

variable "trainer_role_max_session_duration" {
  description = "Maximum session duration of the trainer role in seconds (3600-43200). SDK credential providers refresh role credentials before they expire, so long jobs do not need the maximum."
  type        = number
  default     = 3600

  validation {
    condition     = var.trainer_role_max_session_duration >= 3600 && var.trainer_role_max_session_duration <= 43200
    error_message = "The trainer_role_max_session_duration must be between 3600 and 43200 seconds."
  }
}

variable "trainer_role_permissions_boundary_arn" {
  description = "Optional permissions boundary for the trainer role."
  type        = string
  default     = null
}

variable "create_trainer_instance_profile" {
  description = "Also create an EC2 instance profile for the trainer role (needs create_trainer_role)."
  type        = bool
  default     = false
}
