# A single-node training job on Azure Spot GPUs (one T4 on Standard_NC4as_T4_v3). Then:
#   terraform init && terraform apply
# The scale set starts one Spot VM; cloud-init installs spotguard and the code and runs
# `spotguard run` as spotguard-job.service. When Azure evicts it, the scale set restores an
# instance when capacity returns, and the new VM resumes from the newest checkpoint.

terraform {
  required_version = ">= 1.5"
  required_providers {
    azurerm = {
      source  = "hashicorp/azurerm"
      version = ">= 4.0"
    }
  }
}

provider "azurerm" {
  features {}
  subscription_id     = "00000000-0000-0000-0000-000000000000"
  storage_use_azuread = true # the account has no shared keys
}

module "trainer" {
  source = "../../azure"

  name                 = "charlm"
  resource_group_name  = "training"
  location             = "eastus"
  vm_size              = "Standard_NC4as_T4_v3"
  subnet_id            = "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/training/providers/Microsoft.Network/virtualNetworks/training/subnets/gpu" # with a NAT gateway and the Microsoft.Storage service endpoint
  admin_ssh_public_key = file("~/.ssh/id_ed25519.pub")
  storage_account_name = "myteamspotguardckpt"
  container_name       = "charlm"
  allowed_ip_ranges    = ["203.0.113.0/24"] # where you run `spotguard ls` from

  checkpoint_prefix = "run-1"
  code_repo         = "https://github.com/my-team/charlm.git"
  code_ref          = "v1.0"
  spotguard_package = "spotguard[azure]==0.1.0"
  command           = "python examples/train.py --steps 100000 --every-steps 500"
  grace             = 25 # Azure announces a Spot eviction 30 s ahead

  tags = { team = "ml" }
}

output "storage_url" {
  value = module.trainer.storage_url
}

output "scale_set" {
  value = module.trainer.scale_set
}
