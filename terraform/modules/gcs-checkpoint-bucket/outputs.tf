output "bucket_name" {
  description = "Name of the checkpoint bucket."
  value       = google_storage_bucket.this.name
}

output "bucket_url" {
  description = "gs:// URL of the bucket."
  value       = google_storage_bucket.this.url
}

output "save_folder" {
  description = "Paste into the trainer config: save_folder = \"<this>/<run-name>\" (one folder per run; cloudckpt writes <save_folder>/step<N>/...)."
  value       = "gs://${google_storage_bucket.this.name}/${var.run_prefix}"
}

output "ephemeral_save_folder" {
  description = "Base folder for disposable runs whose objects are deleted after ephemeral_expiration_days (null when ephemeral_prefix is null)."
  value       = var.ephemeral_prefix == null ? null : "gs://${google_storage_bucket.this.name}/${var.ephemeral_prefix}"
}

output "trainer_service_account_email" {
  description = "Email of the trainer service account (null unless create_trainer_service_account)."
  value       = one(google_service_account.trainer[*].email)
}

output "trainer_service_account_member" {
  description = "IAM member string of the trainer service account, e.g. for a GKE KSA annotation or further grants."
  value       = var.create_trainer_service_account ? "serviceAccount:${google_service_account.trainer[0].email}" : null
}

output "iam_condition_expression" {
  description = "The CEL expression that limits trainer and reader bindings to the checkpoint prefixes."
  value       = local.prefix_condition_expression
}
