locals {
  iam_name_prefix = coalesce(var.iam_name_prefix, var.bucket_name)
  use_kms         = var.kms_key_arn != null

  # Key prefixes (with trailing slash) that trainers write and evaluators read.
  # The trailing slash keeps "runs/" from also matching "runs-old/...".
  access_prefixes = concat(
    ["${var.run_prefix}/"],
    var.ephemeral_prefix == null ? [] : ["${var.ephemeral_prefix}/"],
  )

  # Would the ephemeral expiry rule reach persistent checkpoints?
  ephemeral_covers_runs = var.ephemeral_prefix != null && (
    var.run_prefix == coalesce(var.ephemeral_prefix, "-") ||
    startswith("${var.run_prefix}/", "${coalesce(var.ephemeral_prefix, "-")}/")
  )
}

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles storage and adds inter-region transfer for multi-TB checkpoints; it is a per-organisation disaster-recovery decision, made with an aws_s3_bucket_replication_configuration outside this module.
  #checkov:skip=CKV2_AWS_62:Event notifications have no consumer here; cloudckpt discovers checkpoints through the .metadata.json commit marker, not events.
  #checkov:skip=CKV_AWS_21:Versioning is an option (var.versioning_enabled), off by default: prune/gc delete multi-GB checkpoints often, and noncurrent copies would multiply storage cost. See README "Versioning".
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

# ACLs disabled: the bucket owner owns every object, access is IAM only.
resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = local.use_kms ? "aws:kms" : "AES256"
      kms_master_key_id = var.kms_key_arn
    }
    # An S3 Bucket Key cuts KMS requests (and their cost) for SSE-KMS; no effect with SSE-S3.
    bucket_key_enabled = local.use_kms
  }
}

# "Suspended" rather than "Disabled" when off: switching an Enabled bucket back
# is only possible to Suspended, and on a new bucket the two behave the same.
resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = var.versioning_enabled ? "Enabled" : "Suspended"
  }
}

resource "aws_s3_bucket_logging" "this" {
  count = var.access_log_bucket == null ? 0 : 1

  bucket        = aws_s3_bucket.this.id
  target_bucket = var.access_log_bucket
  target_prefix = var.access_log_prefix
}

data "aws_iam_policy_document" "bucket" {
  source_policy_documents = var.additional_bucket_policy_json == null ? [] : [var.additional_bucket_policy_json]

  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid       = "DenyOutdatedTLS"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = [var.minimum_tls_version]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  # Putting a policy while the public access block is being created can fail.
  depends_on = [aws_s3_bucket_public_access_block.this]
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  #checkov:skip=CKV_AWS_300:False positive. The first rule below aborts incomplete multipart uploads bucket-wide, but checkov replaces static `rule` blocks with its rendering of the dynamic ones when a resource mixes both, so it never sees it. tests/test_terraform.py asserts the rule instead.
  bucket = aws_s3_bucket.this.id

  # Bucket-wide backstop for uploads that a crash or preemption cut off.
  # (An abort rule cannot be combined with a tag filter, so it has its own rule.)
  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }

  # Old versions and leftover delete markers; does nothing on a never-versioned
  # bucket, and still cleans up if versioning is suspended later.
  dynamic "rule" {
    for_each = var.noncurrent_version_expiration_days == null ? [] : [var.noncurrent_version_expiration_days]
    content {
      id     = "expire-noncurrent-versions"
      status = "Enabled"

      filter {}

      expiration {
        expired_object_delete_marker = true
      }

      noncurrent_version_expiration {
        noncurrent_days = rule.value
      }

      dynamic "noncurrent_version_transition" {
        for_each = var.noncurrent_transition_days == null ? [] : [var.noncurrent_transition_days]
        content {
          noncurrent_days = noncurrent_version_transition.value
          storage_class   = var.noncurrent_transition_storage_class
        }
      }
    }
  }

  dynamic "rule" {
    for_each = var.ephemeral_prefix == null ? [] : [var.ephemeral_prefix]
    content {
      id     = "expire-ephemeral-prefix"
      status = "Enabled"

      filter {
        prefix = "${rule.value}/"
      }

      expiration {
        days = var.ephemeral_expiration_days
      }

      # On a versioned bucket, do not keep disposable data as noncurrent versions.
      noncurrent_version_expiration {
        noncurrent_days = 1
      }
    }
  }

  dynamic "rule" {
    for_each = var.ephemeral_tag == null ? [] : [var.ephemeral_tag]
    content {
      id     = "expire-ephemeral-tag"
      status = "Enabled"

      filter {
        tag {
          key   = rule.value.key
          value = rule.value.value
        }
      }

      expiration {
        days = var.ephemeral_expiration_days
      }
    }
  }

  dynamic "rule" {
    for_each = var.transition_days == null ? [] : [var.transition_days]
    content {
      id     = "transition-runs"
      status = "Enabled"

      filter {
        prefix = "${var.run_prefix}/"
      }

      transition {
        days          = rule.value
        storage_class = var.transition_storage_class
      }
    }
  }

  lifecycle {
    precondition {
      condition     = !local.ephemeral_covers_runs
      error_message = "The ephemeral_prefix must not contain run_prefix: the ephemeral expiry rule would delete persistent checkpoints."
    }

    precondition {
      condition     = var.transition_days == null || !contains(["STANDARD_IA", "ONEZONE_IA"], var.transition_storage_class) || coalesce(var.transition_days, 30) >= 30
      error_message = "S3 requires transition_days >= 30 for STANDARD_IA and ONEZONE_IA."
    }
  }

  # Lifecycle rules on noncurrent versions need the versioning state settled first.
  depends_on = [aws_s3_bucket_versioning.this]
}
