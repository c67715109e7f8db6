output "save_folder" {
  description = "Base save_folder for persistent runs: use <this>/<run-name> in the trainer config."
  value       = module.checkpoints.save_folder
}

output "ephemeral_save_folder" {
  description = "Base save_folder for throwaway runs (objects are deleted)."
  value       = module.checkpoints.ephemeral_save_folder
}

output "trainer_service_account_email" {
  description = "Annotate the Kubernetes service account with iam.gke.io/gcp-service-account=<this>."
  value       = module.checkpoints.trainer_service_account_email
}
