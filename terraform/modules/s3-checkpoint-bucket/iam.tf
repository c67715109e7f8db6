# Least-privilege policies for the two kinds of callers cloudckpt has:
#   trainers   save, resume, prune and gc (read/write/delete objects, abort uploads)
#   evaluators list, inspect, verify and download (read only)
# Both are limited to local.access_prefixes. Neither can delete object
# versions, change the bucket, or touch other prefixes' objects.

locals {
  object_arns          = [for p in local.access_prefixes : "${aws_s3_bucket.this.arn}/${p}*"]
  list_prefix_patterns = [for p in local.access_prefixes : "${p}*"]
}

data "aws_iam_policy_document" "trainer" {
  # ListObjectsV2 inside the prefixes. "IfExists": S3 also consults
  # s3:ListBucket when answering a HEAD/GET for a missing key (404 with it,
  # 403 without), and that check carries no s3:prefix. cloudckpt relies on the
  # 404 ("no marker yet"). Trade-off: a list request without any prefix can
  # enumerate key names bucket-wide (names only, never contents).
  statement {
    sid       = "ListCheckpointPrefixes"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]

    condition {
      test     = "StringLikeIfExists"
      variable = "s3:prefix"
      values   = local.list_prefix_patterns
    }
  }

  # `cloudckpt gc` lists pending multipart uploads (filtered to the run's
  # folder client-side by prefix) and aborts the stale ones.
  statement {
    sid       = "BucketLevelReads"
    actions   = ["s3:GetBucketLocation", "s3:ListBucketMultipartUploads"]
    resources = [aws_s3_bucket.this.arn]
  }

  statement {
    sid = "ReadWriteDeleteCheckpoints"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = local.object_arns
  }

  dynamic "statement" {
    for_each = local.use_kms ? [var.kms_key_arn] : []
    content {
      sid       = "UseBucketKmsKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["s3.${aws_s3_bucket.this.region}.amazonaws.com"]
      }
    }
  }
}

data "aws_iam_policy_document" "evaluator" {
  statement {
    sid       = "ListCheckpointPrefixes"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]

    condition {
      test     = "StringLikeIfExists"
      variable = "s3:prefix"
      values   = local.list_prefix_patterns
    }
  }

  statement {
    sid       = "BucketLocation"
    actions   = ["s3:GetBucketLocation"]
    resources = [aws_s3_bucket.this.arn]
  }

  statement {
    sid       = "ReadCheckpoints"
    actions   = ["s3:GetObject"]
    resources = local.object_arns
  }

  dynamic "statement" {
    for_each = local.use_kms ? [var.kms_key_arn] : []
    content {
      sid       = "DecryptWithBucketKmsKey"
      actions   = ["kms:Decrypt"]
      resources = [statement.value]

      condition {
        test     = "StringEquals"
        variable = "kms:ViaService"
        values   = ["s3.${aws_s3_bucket.this.region}.amazonaws.com"]
      }
    }
  }
}

resource "aws_iam_policy" "trainer" {
  count = var.create_iam_policies ? 1 : 0

  name        = "${local.iam_name_prefix}-checkpoint-trainer"
  path        = var.iam_path
  description = "cloudckpt trainers: read/write/delete checkpoints under ${join(", ", local.access_prefixes)} in s3://${var.bucket_name}"
  policy      = data.aws_iam_policy_document.trainer.json
  tags        = var.tags
}

resource "aws_iam_policy" "evaluator" {
  count = var.create_iam_policies ? 1 : 0

  name        = "${local.iam_name_prefix}-checkpoint-evaluator"
  path        = var.iam_path
  description = "cloudckpt evaluators: read-only access to checkpoints under ${join(", ", local.access_prefixes)} in s3://${var.bucket_name}"
  policy      = data.aws_iam_policy_document.evaluator.json
  tags        = var.tags
}

# ---------------------------------------------------------------------------
# Optional role (and instance profile) for training jobs
# ---------------------------------------------------------------------------

data "aws_iam_policy_document" "trainer_trust" {
  statement {
    sid     = "TrustedServices"
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = var.trainer_role_trusted_services
    }
  }
}

resource "aws_iam_role" "trainer" {
  count = var.create_trainer_role ? 1 : 0

  name                 = "${local.iam_name_prefix}-checkpoint-trainer"
  path                 = var.iam_path
  description          = "Training jobs writing cloudckpt checkpoints to s3://${var.bucket_name}"
  assume_role_policy   = coalesce(var.trainer_role_assume_role_policy_json, data.aws_iam_policy_document.trainer_trust.json)
  max_session_duration = var.trainer_role_max_session_duration
  permissions_boundary = var.trainer_role_permissions_boundary_arn
  tags                 = var.tags

  lifecycle {
    precondition {
      condition     = var.create_iam_policies
      error_message = "The create_trainer_role option needs create_iam_policies = true (the role gets the trainer policy)."
    }
  }
}

resource "aws_iam_role_policy_attachment" "trainer" {
  count = var.create_trainer_role && var.create_iam_policies ? 1 : 0

  role       = aws_iam_role.trainer[0].name
  policy_arn = aws_iam_policy.trainer[0].arn
}

resource "aws_iam_instance_profile" "trainer" {
  count = var.create_trainer_role && var.create_trainer_instance_profile ? 1 : 0

  name = "${local.iam_name_prefix}-checkpoint-trainer"
  path = var.iam_path
  role = aws_iam_role.trainer[0].name
  tags = var.tags
}
