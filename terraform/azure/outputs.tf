output "storage_url" {
  description = "Where the job's checkpoints live: `spotguard ls <storage_url>` from a machine with access."
  value       = local.storage_url
}

output "storage_account" {
  description = "Checkpoint storage account name."
  value       = azurerm_storage_account.this.name
}

output "scale_set" {
  description = "The VM scale set of Spot VMs."
  value       = azurerm_linux_virtual_machine_scale_set.this.name
}

output "identity_client_id" {
  description = "Client id of the VMs' managed identity (AZURE_CLIENT_ID in the job's environment)."
  value       = azurerm_user_assigned_identity.this.client_id
}

output "custom_data" {
  description = "The rendered bootstrap script (for review)."
  value       = local.custom_data
}
