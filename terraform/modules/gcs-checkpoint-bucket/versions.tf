terraform {
  # startswith/strcontains in variable validations need 1.5.
  required_version = ">= 1.5"

  required_providers {
    google = {
      source = "hashicorp/google"
      # soft_delete_policy on google_storage_bucket needs 5.22 or later.
      version = ">= 5.22, < 8.0"
    }
  }
}
