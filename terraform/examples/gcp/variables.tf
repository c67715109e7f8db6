variable "project_id" {
  description = "Project that holds the bucket and the trainer service account."
  type        = string
  default     = "example-ml-project"
}

variable "region" {
  description = "Region of the bucket: the one the GPUs run in (no inter-region transfer charges, lowest latency)."
  type        = string
  default     = "us-central1"
}

variable "bucket_name" {
  description = "Globally unique bucket name."
  type        = string
  default     = "example-org-ml-checkpoints"
}

variable "gke_namespace" {
  description = "Kubernetes namespace of the training jobs (for Workload Identity)."
  type        = string
  default     = "training"
}

variable "gke_service_account" {
  description = "Kubernetes service account the training pods run as (for Workload Identity)."
  type        = string
  default     = "trainer"
}

variable "reader_members" {
  description = "Who may read checkpoints (evaluation jobs, notebooks)."
  type        = list(string)
  default     = ["group:ml-researchers@example.com"]
}
