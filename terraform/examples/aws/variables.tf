variable "region" {
  description = "AWS region for the bucket: the one the training instances run in (no inter-region transfer charges, lowest latency)."
  type        = string
  default     = "us-east-1"
}

variable "bucket_name" {
  description = "Globally unique bucket name."
  type        = string
  default     = "example-org-ml-checkpoints"
}
