output "bucket_name" {
  description = "Name of the checkpoint bucket."
  value       = aws_s3_bucket.this.id
}

output "bucket_arn" {
  description = "ARN of the checkpoint bucket."
  value       = aws_s3_bucket.this.arn
}

output "bucket_region" {
  description = "Region of the bucket: set AWS_REGION (or the `region` option) to this in trainer jobs."
  value       = aws_s3_bucket.this.region
}

output "save_folder" {
  description = "Paste into the trainer config: save_folder = \"<this>/<run-name>\" (one folder per run; cloudckpt writes <save_folder>/step<N>/...)."
  value       = "s3://${aws_s3_bucket.this.id}/${var.run_prefix}"
}

output "ephemeral_save_folder" {
  description = "Base folder for disposable runs whose objects expire after ephemeral_expiration_days (null when ephemeral_prefix is null)."
  value       = var.ephemeral_prefix == null ? null : "s3://${aws_s3_bucket.this.id}/${var.ephemeral_prefix}"
}

output "trainer_policy_arn" {
  description = "ARN of the trainer managed policy (null when create_iam_policies is false)."
  value       = one(aws_iam_policy.trainer[*].arn)
}

output "evaluator_policy_arn" {
  description = "ARN of the read-only evaluator managed policy (null when create_iam_policies is false)."
  value       = one(aws_iam_policy.evaluator[*].arn)
}

output "trainer_policy_json" {
  description = "Trainer policy document, for attaching inline or in another account."
  value       = data.aws_iam_policy_document.trainer.json
}

output "evaluator_policy_json" {
  description = "Evaluator (read-only) policy document."
  value       = data.aws_iam_policy_document.evaluator.json
}

output "trainer_role_arn" {
  description = "ARN of the trainer role (null unless create_trainer_role)."
  value       = one(aws_iam_role.trainer[*].arn)
}

output "trainer_role_name" {
  description = "Name of the trainer role (null unless create_trainer_role)."
  value       = one(aws_iam_role.trainer[*].name)
}

output "trainer_instance_profile_name" {
  description = "Name of the trainer instance profile (null unless create_trainer_instance_profile)."
  value       = one(aws_iam_instance_profile.trainer[*].name)
}
