# A spot fleet for one training job: a launch template and an Auto Scaling group that replaces
# a reclaimed machine with a new one, which installs spotguard and resumes from the bucket.

locals {
  storage_url = "s3://${var.bucket_name}/${var.checkpoint_prefix}"
  kms_key_arn = var.kms_key_arn != null ? var.kms_key_arn : aws_kms_key.this[0].arn
  # With capacity rebalancing the group launches a replacement on a rebalance recommendation, and
  # that replacement resumes from the bucket. The old machine must then stop with an emergency
  # checkpoint (the job's Guard stops on the advisory notice) rather than keep training the same
  # steps beside the new one, whose results would be lost or overwrite each other.
  job_environment = var.capacity_rebalance ? { SPOTGUARD_STOP_ON_ADVISORY = "1" } : {}
  user_data = templatefile("${path.module}/../bootstrap/spotguard-bootstrap.sh.tftpl", {
    python       = var.python
    pip_install  = var.spotguard_package
    code_repo    = var.code_repo
    code_ref     = var.code_ref
    command      = replace(var.command, "%", "%%") # systemd specifiers
    storage_url  = local.storage_url
    max_restarts = var.max_restarts
    hang_timeout = var.hang_timeout
    grace        = var.grace
    run_as       = var.run_as
    environment  = local.job_environment
  })
}

resource "aws_launch_template" "this" {
  # checkov:skip=CKV_AWS_341: hop limit 2 lets a containerised trainer reach IMDSv2 (tokens are still required) to read spot notices.
  name_prefix   = "${var.name}-"
  image_id      = var.image_id
  ebs_optimized = true
  user_data     = base64encode(local.user_data)

  # No instance_market_options here: an Auto Scaling group with a mixed instances policy rejects
  # a launch template that requests spot itself. Spot is set in the group's instances_distribution.

  iam_instance_profile {
    arn = aws_iam_instance_profile.this.arn
  }

  vpc_security_group_ids = var.security_group_ids

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required" # IMDSv2 only
    http_put_response_hop_limit = 2          # containers on the host can reach IMDS for spot notices
    instance_metadata_tags      = "disabled"
  }

  block_device_mappings {
    device_name = var.root_device_name
    ebs {
      volume_size           = var.root_volume_gb
      volume_type           = "gp3"
      encrypted             = true
      kms_key_id            = local.kms_key_arn
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = var.name, "spotguard:job" = var.name })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(var.tags, { "spotguard:job" = var.name })
  }

  tags = var.tags
}

resource "aws_autoscaling_group" "this" {
  name                = var.name
  min_size            = var.instance_count
  max_size            = var.instance_count
  desired_capacity    = var.instance_count
  vpc_zone_identifier = var.subnet_ids
  health_check_type   = "EC2"
  capacity_rebalance  = var.capacity_rebalance # a replacement starts on a rebalance recommendation (see locals)

  mixed_instances_policy {
    instances_distribution {
      on_demand_base_capacity                  = 0
      on_demand_percentage_above_base_capacity = 0
      spot_allocation_strategy                 = "capacity-optimized"
    }

    launch_template {
      launch_template_specification {
        launch_template_id = aws_launch_template.this.id
        version            = aws_launch_template.this.latest_version
      }

      dynamic "override" {
        for_each = var.instance_types
        content {
          instance_type = override.value
        }
      }
    }
  }

  dynamic "tag" {
    for_each = merge(var.tags, { "spotguard:job" = var.name })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = false # the launch template tags instances and volumes
    }
  }
}
