# A single-node training job on AWS spot GPUs. Fill in the AMI, subnets and security group, then:
#   terraform init && terraform apply
# The Auto Scaling group starts one spot instance; its user data installs spotguard and the code
# and runs `spotguard run` as spotguard-job.service. When AWS reclaims it, the group starts a
# replacement, which resumes from the newest checkpoint in the bucket.

terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0"
    }
  }
}

provider "aws" {
  region = "us-east-1"
}

module "trainer" {
  source = "../../aws"

  name               = "charlm"
  region             = "us-east-1"
  image_id           = "ami-0123456789abcdef0" # an AWS Deep Learning AMI (Ubuntu) with PyTorch
  instance_types     = ["g5.xlarge", "g5.2xlarge", "g6.xlarge", "g4dn.xlarge"]
  subnet_ids         = ["subnet-0aaaaaaaaaaaaaaaa", "subnet-0bbbbbbbbbbbbbbbb", "subnet-0cccccccccccccccc"]
  security_group_ids = ["sg-0123456789abcdef0"] # outbound HTTPS only
  bucket_name        = "my-team-spotguard-checkpoints"
  checkpoint_prefix  = "charlm/run-1"

  code_repo         = "https://github.com/my-team/charlm.git"
  code_ref          = "v1.0"
  spotguard_package = "spotguard[aws]==0.1.0"
  python            = "/opt/conda/bin/python"
  command           = "python examples/train.py --steps 100000 --every-steps 500"
  hang_timeout      = 1800
  grace             = 100

  tags = { team = "ml" }
}

output "storage_url" {
  value = module.trainer.storage_url
}

output "autoscaling_group_name" {
  value = module.trainer.autoscaling_group_name
}
