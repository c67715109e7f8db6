output "save_folder" {
  description = "Base save_folder for persistent runs: use <this>/<run-name> in the trainer config."
  value       = module.checkpoints.save_folder
}

output "ephemeral_save_folder" {
  description = "Base save_folder for throwaway runs (objects expire)."
  value       = module.checkpoints.ephemeral_save_folder
}

output "bucket_region" {
  description = "Set AWS_REGION to this in training jobs."
  value       = module.checkpoints.bucket_region
}

output "trainer_instance_profile_name" {
  description = "Instance profile to launch training instances with."
  value       = module.checkpoints.trainer_instance_profile_name
}

output "evaluator_policy_arn" {
  description = "Attach to evaluation / notebook roles for read-only access."
  value       = module.checkpoints.evaluator_policy_arn
}
