# The VMs' identity: one user-assigned managed identity with "Storage Blob Data Contributor" on
# the job's container only: no role on the account, the resource group or the subscription.

resource "azurerm_user_assigned_identity" "this" {
  name                = "${var.name}-trainer"
  resource_group_name = var.resource_group_name
  location            = var.location
  tags                = var.tags
}

resource "azurerm_role_assignment" "checkpoints" {
  scope                = "${azurerm_storage_account.this.id}/blobServices/default/containers/${azurerm_storage_container.checkpoints.name}"
  role_definition_name = "Storage Blob Data Contributor"
  principal_id         = azurerm_user_assigned_identity.this.principal_id
  principal_type       = "ServicePrincipal"
}
