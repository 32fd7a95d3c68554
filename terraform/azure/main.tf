# A spot fleet for one training job on Azure: a Linux VM scale set of Spot VMs that restores
# evicted instances when capacity returns; each new VM installs spotguard and resumes from the
# checkpoint container.

locals {
  storage_url = "az://${var.container_name}@${var.storage_account_name}.blob.core.windows.net/${var.checkpoint_prefix}"
  # DefaultAzureCredential picks the user-assigned identity by its client id.
  job_environment = { AZURE_CLIENT_ID = azurerm_user_assigned_identity.this.client_id }
  custom_data = templatefile("${path.module}/../bootstrap/spotguard-bootstrap.sh.tftpl", {
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

resource "azurerm_linux_virtual_machine_scale_set" "this" {
  name                = var.name
  resource_group_name = var.resource_group_name
  location            = var.location
  sku                 = var.vm_size
  instances           = var.instance_count
  zones               = var.zones
  upgrade_mode        = "Manual" # a running job is not replaced by a model change
  tags                = var.tags

  # Spot: evicted for capacity only (max_bid_price -1 pays up to the on-demand price, never
  # evicted for price). Eviction comes with a Preempt scheduled event at least 30 s ahead.
  priority        = "Spot"
  eviction_policy = var.eviction_policy
  max_bid_price   = -1

  # Evicted (deleted) instances are recreated when spot capacity returns; a new one resumes.
  spot_restore {
    enabled = true
    timeout = "PT1H"
  }

  # Scale-in and deletions also announce themselves (a Terminate scheduled event) so the job
  # gets its emergency checkpoint.
  termination_notification {
    enabled = true
    timeout = "PT5M"
  }

  admin_username                  = var.admin_username
  disable_password_authentication = true
  admin_ssh_key {
    username   = var.admin_username
    public_key = var.admin_ssh_public_key
  }

  custom_data                = base64encode(local.custom_data) # cloud-init runs it at first boot
  encryption_at_host_enabled = var.encryption_at_host
  secure_boot_enabled        = var.secure_boot
  vtpm_enabled               = var.secure_boot

  source_image_reference {
    publisher = var.image.publisher
    offer     = var.image.offer
    sku       = var.image.sku
    version   = var.image.version
  }

  os_disk {
    caching              = "ReadWrite"
    storage_account_type = "Premium_LRS"
    disk_size_gb         = var.disk_size_gb
  }

  network_interface {
    name    = "${var.name}-nic"
    primary = true

    ip_configuration {
      name      = "internal"
      primary   = true
      subnet_id = var.subnet_id
      # no public_ip_address block: no public IP
    }
  }

  identity {
    type         = "UserAssigned"
    identity_ids = [azurerm_user_assigned_identity.this.id]
  }

  boot_diagnostics {} # managed storage account
}
