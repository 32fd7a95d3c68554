output "storage_url" {
  description = "Where the job's checkpoints live: `spotguard ls <storage_url>` from a machine with access."
  value       = local.storage_url
}

output "bucket" {
  description = "Checkpoint bucket name."
  value       = aws_s3_bucket.checkpoints.id
}

output "autoscaling_group_name" {
  description = "The spot fleet's Auto Scaling group."
  value       = aws_autoscaling_group.this.name
}

output "role_arn" {
  description = "IAM role of the instances."
  value       = aws_iam_role.this.arn
}

output "user_data" {
  description = "The rendered bootstrap script (for review)."
  value       = local.user_data
}
