# A checkpoint bucket for one team: persistent runs under runs/, throwaway runs
# (smoke tests, sweeps) under scratch/ that expire after 3 days, run checkpoints
# tiered automatically after 30 days, and a role for EC2 training instances.
module "checkpoints" {
  source = "../../modules/s3-checkpoint-bucket"

  bucket_name = var.bucket_name

  run_prefix                = "runs"
  ephemeral_prefix          = "scratch"
  ephemeral_expiration_days = 3

  abort_incomplete_multipart_days = 3
  transition_days                 = 30
  transition_storage_class        = "INTELLIGENT_TIERING"

  versioning_enabled = false

  create_trainer_role             = true
  create_trainer_instance_profile = true

  tags = {
    team = "ml-platform"
  }
}
