variable "name" {
  description = "Name of the job: prefixes every resource."
  type        = string
  default     = "spotguard"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,25}$", var.name))
    error_message = "name: 2-26 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "project" {
  description = "GCP project id."
  type        = string
}

variable "region" {
  description = "Region of the instance group and the bucket."
  type        = string
}

variable "zones" {
  description = "Zones of the region that offer the machine and GPU type; the group starts VMs where spot capacity is."
  type        = list(string)
  validation {
    condition     = length(var.zones) > 0
    error_message = "zones: give at least one zone."
  }
}

variable "machine_type" {
  description = "Machine type (e.g. g2-standard-8 has one L4; n1-standard-8 with a guest accelerator)."
  type        = string
  default     = "g2-standard-8"
}

variable "accelerator_type" {
  description = "Guest accelerator for N1 machine types (e.g. nvidia-tesla-t4); null for A2/A3/G2, which bring their GPUs."
  type        = string
  default     = null
}

variable "accelerator_count" {
  description = "Number of guest accelerators when accelerator_type is set."
  type        = number
  default     = 1
}

variable "image" {
  description = "Boot image with Python 3.10+, git and the GPU stack (e.g. a Deep Learning VM image with PyTorch)."
  type        = string
}

variable "disk_size_gb" {
  description = "Boot disk size."
  type        = number
  default     = 200
}

variable "secure_boot" {
  description = "Shielded VM secure boot; the GPU driver of the image must be signed (Deep Learning VM images are)."
  type        = bool
  default     = true
}

variable "network" {
  description = "VPC network self link or name."
  type        = string
  default     = "default"
}

variable "subnetwork" {
  description = "Subnetwork; the instances get no public IP, so it needs Cloud NAT or Private Google Access plus a package mirror."
  type        = string
  default     = null
}

variable "instance_count" {
  description = "Machines in the managed instance group (1 for a single-node job)."
  type        = number
  default     = 1
}

variable "termination_action" {
  description = "What GCE does with a preempted spot VM: DELETE (the group recreates it from the template, a fresh boot) or STOP."
  type        = string
  default     = "DELETE"
  validation {
    condition     = contains(["STOP", "DELETE"], var.termination_action)
    error_message = "termination_action: STOP or DELETE."
  }
}

variable "bucket_name" {
  description = "Name of the checkpoint bucket (globally unique)."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name: 3-63 lowercase letters, digits, dots, dashes or underscores."
  }
}

variable "checkpoint_prefix" {
  description = "Object prefix of this job's checkpoints; the service account may touch nothing else."
  type        = string
  default     = "checkpoints/job-1"
  validation {
    condition     = can(regex("^[A-Za-z0-9][A-Za-z0-9._/-]*[A-Za-z0-9]$", var.checkpoint_prefix)) && !strcontains(var.checkpoint_prefix, "..")
    error_message = "checkpoint_prefix: letters, digits, . _ - /, no leading or trailing slash, no '..'."
  }
}

variable "noncurrent_days" {
  description = "Days a deleted or overwritten checkpoint object is kept as a noncurrent version."
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
  default     = "spotguard[gcp]"
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
  description = "Seconds the job gets for its emergency checkpoint after a stop signal (GCE gives spot VMs 30 s in all)."
  type        = number
  default     = 25
  validation {
    condition     = var.grace == floor(var.grace) && var.grace >= 1 && var.grace <= 3600
    error_message = "grace: whole seconds from 1 to 3600."
  }
}

variable "labels" {
  description = "Labels for every resource that takes them."
  type        = map(string)
  default     = {}
}
