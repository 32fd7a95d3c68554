output "storage_url" {
  description = "Where the job's checkpoints live: `spotguard ls <storage_url>` from a machine with access."
  value       = local.storage_url
}

output "bucket" {
  description = "Checkpoint bucket name."
  value       = google_storage_bucket.checkpoints.name
}

output "instance_group" {
  description = "The managed instance group of spot VMs."
  value       = google_compute_region_instance_group_manager.this.name
}

output "service_account_email" {
  description = "Identity of the VMs."
  value       = google_service_account.this.email
}

output "startup_script" {
  description = "The rendered startup script (for review)."
  value       = local.startup_script
}
