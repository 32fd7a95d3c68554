variable "name" {
  description = "Name of the job: prefixes every resource."
  type        = string
  default     = "spotguard"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name: 2-31 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "resource_group_name" {
  description = "Existing resource group for every resource."
  type        = string
}

variable "location" {
  description = "Azure region (e.g. eastus)."
  type        = string
}

variable "zones" {
  description = "Availability zones for the VMs (more zones, more spot capacity); empty for a region without zones."
  type        = list(string)
  default     = ["1", "2", "3"]
}

variable "vm_size" {
  description = "VM size with a GPU (e.g. Standard_NC4as_T4_v3, Standard_NC24ads_A100_v4)."
  type        = string
  default     = "Standard_NC4as_T4_v3"
}

variable "instance_count" {
  description = "VMs in the scale set (1 for a single-node job)."
  type        = number
  default     = 1
}

variable "eviction_policy" {
  description = "What Azure does with an evicted Spot VM: Delete (spot_restore recreates it, a fresh boot) or Deallocate (disks kept and billed)."
  type        = string
  default     = "Delete"
  validation {
    condition     = contains(["Delete", "Deallocate"], var.eviction_policy)
    error_message = "eviction_policy: Delete or Deallocate."
  }
}

variable "image" {
  description = "Marketplace image with Python 3.10+, git and the GPU stack (e.g. the Data Science VM for Ubuntu)."
  type = object({
    publisher = string
    offer     = string
    sku       = string
    version   = string
  })
  default = {
    publisher = "microsoft-dsvm"
    offer     = "ubuntu-hpc"
    sku       = "2204"
    version   = "latest"
  }
}

variable "disk_size_gb" {
  description = "OS disk size."
  type        = number
  default     = 200
}

variable "encryption_at_host" {
  description = "Encrypt temp disks and caches on the host (needs the EncryptionAtHost feature registered in the subscription)."
  type        = bool
  default     = true
}

variable "secure_boot" {
  description = "Trusted launch secure boot and vTPM; the image and its GPU driver must support it."
  type        = bool
  default     = false
}

variable "subnet_id" {
  description = "Subnet of the VMs, with the Microsoft.Storage service endpoint and outbound access to the package index (NAT gateway); the VMs get no public IP."
  type        = string
}

variable "allowed_ip_ranges" {
  description = "Public IP ranges (CIDR) that may reach the storage account besides the subnet, e.g. your workstation for `spotguard ls`."
  type        = list(string)
  default     = []
}

variable "admin_username" {
  description = "Admin user of the VMs (SSH key only)."
  type        = string
  default     = "azureuser"
}

variable "admin_ssh_public_key" {
  description = "SSH public key of the admin user; password authentication is off."
  type        = string
}

variable "storage_account_name" {
  description = "Name of the checkpoint storage account (globally unique)."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9]{3,24}$", var.storage_account_name))
    error_message = "storage_account_name: 3-24 lowercase letters or digits."
  }
}

variable "replication" {
  description = "Replication of the storage account (LRS, ZRS, GRS ...)."
  type        = string
  default     = "ZRS"
}

variable "cmk_key_vault_key_id" {
  description = "Key Vault key that encrypts the account (customer-managed key); null for Microsoft-managed keys. The VMs' identity must hold get/wrap/unwrap on it."
  type        = string
  default     = null
}

variable "container_name" {
  description = "The job's container: the VMs' identity may touch nothing else."
  type        = string
  default     = "checkpoints"
  validation {
    condition     = can(regex("^[a-z0-9](-?[a-z0-9])+$", var.container_name)) && length(var.container_name) <= 63
    error_message = "container_name: 3-63 lowercase letters, digits or single dashes."
  }
}

variable "checkpoint_prefix" {
  description = "Blob prefix of this job's checkpoints in the container."
  type        = string
  default     = "job-1"
  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._/-]*[A-Za-z0-9]$", var.checkpoint_prefix)) && !strcontains(var.checkpoint_prefix, "..")
    error_message = "checkpoint_prefix: letters, digits, . _ - /, no leading or trailing slash, no '..'."
  }
}

variable "noncurrent_days" {
  description = "Days a deleted or overwritten checkpoint blob is kept as a previous version (and deleted blobs as soft-deleted)."
  type        = number
  default     = 7
}

variable "command" {
  description = "The training command, run by `spotguard run` in the code checkout. One line, systemd ExecStart syntax: write $$ for a literal $."
  type        = string
  validation {
    condition     = length(trimspace(var.command)) > 0 && !can(regex("[[:cntrl:]]", var.command)) && !endswith(var.command, "\\")
    error_message = "command: one non-empty line without control characters, not ending in a backslash (systemd would join the next unit line to it)."
  }
}

variable "code_repo" {
  description = "Git URL of the training code (cloned to /opt/spotguard/code); empty for none."
  type        = string
  default     = ""
  validation {
    condition     = var.code_repo == "" || can(regex("^((https?|ssh|git|file)://|[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:)[A-Za-z0-9._~:/?#@!$&()*+,;=%-]+$", var.code_repo))
    error_message = "code_repo: an https://, ssh://, git://, file:// or user@host: git URL, without spaces or quotes."
  }
}

variable "code_ref" {
  description = "Branch or tag of code_repo to run."
  type        = string
  default     = "main"
  validation {
    condition     = can(regex("^[A-Za-z0-9_][A-Za-z0-9._/-]{0,199}$", var.code_ref)) && !strcontains(var.code_ref, "..")
    error_message = "code_ref: a branch or tag name (letters, digits, . _ - /; not starting with - or .)."
  }
}

variable "spotguard_package" {
  description = "pip arguments that install spotguard (pin a version in production)."
  type        = string
  default     = "spotguard[azure]"
  validation {
    condition     = can(regex("^[A-Za-z0-9_.,:/@=<>~!+\\[\\] -]+$", var.spotguard_package))
    error_message = "spotguard_package: pip requirement characters only."
  }
}

variable "python" {
  description = "Interpreter of the image that has torch; the job's venv is created from it with system site packages."
  type        = string
  default     = "python3"
  validation {
    condition     = can(regex("^[A-Za-z0-9_./][A-Za-z0-9_./-]*$", var.python))
    error_message = "python: a command name or path."
  }
}

variable "run_as" {
  description = "User that runs the job: created at boot (a system account) when the image has none of that name. Not root by default."
  type        = string
  default     = "spotguard"
  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,31}$", var.run_as))
    error_message = "run_as: a user name (lowercase letters, digits, _ or -, at most 32, starting with a letter or _)."
  }
}

variable "max_restarts" {
  description = "Restarts of the job after crashes or hangs on one machine (spotguard run --max-restarts)."
  type        = number
  default     = 10
  validation {
    condition     = var.max_restarts == floor(var.max_restarts) && var.max_restarts >= 0 && var.max_restarts <= 10000
    error_message = "max_restarts: a whole number from 0 to 10000."
  }
}

variable "hang_timeout" {
  description = "Seconds without a completed step before the job counts as hung; 0 turns the watchdog off."
  type        = number
  default     = 1800
  validation {
    condition     = var.hang_timeout == floor(var.hang_timeout) && var.hang_timeout >= 0 && var.hang_timeout <= 604800
    error_message = "hang_timeout: whole seconds from 0 (off) to 604800 (a week)."
  }
}

variable "grace" {
  description = "Seconds the job gets for its emergency checkpoint after a stop signal (Azure announces a Spot eviction 30 s ahead)."
  type        = number
  default     = 25
  validation {
    condition     = var.grace == floor(var.grace) && var.grace >= 1 && var.grace <= 3600
    error_message = "grace: whole seconds from 1 to 3600."
  }
}

variable "tags" {
  description = "Tags for every resource that takes them."
  type        = map(string)
  default     = {}
}
