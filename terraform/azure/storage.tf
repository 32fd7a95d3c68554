# The checkpoint storage account: TLS 1.2 only, HTTPS only, no anonymous access, no shared keys
# (Entra ID only), reachable only from the job's subnet, double encrypted, versioned; one private
# container for the job.

resource "azurerm_storage_account" "this" {
  # checkov:skip=CKV_AZURE_33: queue logging; this account holds blobs only and has no queues in use.
  # checkov:skip=CKV_AZURE_206: zone-redundant (ZRS) by default; geo-replication doubles the cost of re-creatable state (replication = "GRS" to have it).
  # checkov:skip=CKV2_AZURE_33: a private endpoint needs a private DNS zone the caller owns; access is limited to the job's subnet by a service endpoint instead.
  # checkov:skip=CKV_AZURE_59: public network access stays on so that the service-endpoint rule can admit the job's subnet; network_rules deny everything else.
  name                              = var.storage_account_name
  resource_group_name               = var.resource_group_name
  location                          = var.location
  account_tier                      = "Standard"
  account_kind                      = "StorageV2"
  account_replication_type          = var.replication
  min_tls_version                   = "TLS1_2"
  https_traffic_only_enabled        = true
  allow_nested_items_to_be_public   = false
  shared_access_key_enabled         = false # Entra ID (the managed identity) only: no account keys, no SAS
  default_to_oauth_authentication   = true
  local_user_enabled                = false
  infrastructure_encryption_enabled = true
  public_network_access_enabled     = true # needed for the service-endpoint rule below; the rule denies everything else
  tags                              = var.tags

  network_rules {
    default_action             = "Deny"
    bypass                     = ["AzureServices"]
    virtual_network_subnet_ids = [var.subnet_id] # the subnet needs the Microsoft.Storage service endpoint
    ip_rules                   = var.allowed_ip_ranges
  }

  blob_properties {
    versioning_enabled = true
    delete_retention_policy {
      days = var.noncurrent_days
    }
    container_delete_retention_policy {
      days = var.noncurrent_days
    }
  }

  sas_policy {
    expiration_period = "01.00:00:00" # shared keys are off; a day at most if they are ever turned on
  }

  dynamic "identity" { # only to read the customer-managed key
    for_each = var.cmk_key_vault_key_id == null ? [] : [azurerm_user_assigned_identity.this.id]
    content {
      type         = "UserAssigned"
      identity_ids = [identity.value]
    }
  }

  dynamic "customer_managed_key" {
    for_each = var.cmk_key_vault_key_id == null ? [] : [var.cmk_key_vault_key_id]
    content {
      key_vault_key_id          = customer_managed_key.value
      user_assigned_identity_id = azurerm_user_assigned_identity.this.id
    }
  }
}

resource "azurerm_storage_container" "checkpoints" {
  # checkov:skip=CKV2_AZURE_21: read logging for the blob service needs a Log Analytics workspace the caller owns.
  name                  = var.container_name
  storage_account_id    = azurerm_storage_account.this.id
  container_access_type = "private"
}

# spotguard prunes old checkpoints itself (keep N); with versioning on, the pruned blobs become
# previous versions, which are deleted here.
resource "azurerm_storage_management_policy" "this" {
  storage_account_id = azurerm_storage_account.this.id

  rule {
    name    = "expire-old-checkpoint-versions"
    enabled = true
    filters {
      blob_types   = ["blockBlob"]
      prefix_match = ["${var.container_name}/${var.checkpoint_prefix}/"]
    }
    actions {
      version {
        delete_after_days_since_creation = var.noncurrent_days
      }
    }
  }
}
