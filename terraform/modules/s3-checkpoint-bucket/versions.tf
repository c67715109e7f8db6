terraform {
  # startswith/endswith/strcontains in variable validations need 1.5.
  required_version = ">= 1.5"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 7.0"
    }
  }
}
