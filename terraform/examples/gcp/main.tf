# A single-node training job on GCE spot GPUs (one L4 on g2-standard-8). Then:
#   terraform init && terraform apply
# The managed instance group starts one spot VM; its startup script installs spotguard and the
# code and runs `spotguard run` as spotguard-job.service. When GCE preempts it, the group
# recreates it, and the new VM resumes from the newest checkpoint in the bucket.

terraform {
  required_version = ">= 1.5"
  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 5.0"
    }
  }
}

provider "google" {
  project = "my-project"
  region  = "us-central1"
}

module "trainer" {
  source = "../../gcp"

  name         = "charlm"
  project      = "my-project"
  region       = "us-central1"
  zones        = ["us-central1-a", "us-central1-b", "us-central1-c"]
  machine_type = "g2-standard-8"
  image        = "projects/deeplearning-platform-release/global/images/family/pytorch-latest-cu121-debian-11-py310"
  subnetwork   = "projects/my-project/regions/us-central1/subnetworks/training" # with Cloud NAT
  bucket_name  = "my-team-spotguard-checkpoints"

  checkpoint_prefix = "charlm/run-1"
  code_repo         = "https://github.com/my-team/charlm.git"
  code_ref          = "v1.0"
  spotguard_package = "spotguard[gcp]==0.1.0"
  python            = "/opt/conda/bin/python"
  command           = "python examples/train.py --steps 100000 --every-steps 500"
  grace             = 25 # GCE gives a spot VM 30 s between the notice and the power-off

  labels = { team = "ml" }
}

output "storage_url" {
  value = module.trainer.storage_url
}

output "instance_group" {
  value = module.trainer.instance_group
}
