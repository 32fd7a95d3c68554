# The VMs' identity: one user-assigned managed identity with "Storage Blob Data Contributor" on
# the job's container only (no role on the account, the resource group or the subscription), and
# within it on the job's prefix only, as the AWS and GCP modules scope theirs: an ABAC condition
# lets blob reads, writes and deletes through only under "<checkpoint_prefix>/", and listings only
# with a prefix that starts there (RBAC scopes stop at the container; conditions go further).

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
  condition_version    = "2.0"
  condition            = <<-EOT
    (
     (
      !(ActionMatches{'Microsoft.Storage/storageAccounts/blobServices/containers/blobs/read'} AND NOT SubOperationMatches{'Blob.List'})
      AND !(ActionMatches{'Microsoft.Storage/storageAccounts/blobServices/containers/blobs/write'})
      AND !(ActionMatches{'Microsoft.Storage/storageAccounts/blobServices/containers/blobs/add/action'})
      AND !(ActionMatches{'Microsoft.Storage/storageAccounts/blobServices/containers/blobs/delete'})
      AND !(ActionMatches{'Microsoft.Storage/storageAccounts/blobServices/containers/blobs/move/action'})
     )
     OR
     (
      @Resource[Microsoft.Storage/storageAccounts/blobServices/containers/blobs:path] StringStartsWith '${var.checkpoint_prefix}/'
     )
    )
    AND
    (
     (
      !(ActionMatches{'Microsoft.Storage/storageAccounts/blobServices/containers/blobs/read'} AND SubOperationMatches{'Blob.List'})
     )
     OR
     (
      @Request[Microsoft.Storage/storageAccounts/blobServices/containers/blobs:prefix] StringStartsWith '${var.checkpoint_prefix}/'
     )
    )
  EOT
}
