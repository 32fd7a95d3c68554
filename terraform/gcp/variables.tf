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
    condition     = length(trimspace(var.command)) > 0 && !strcontains(var.command, "\n")
    error_message = "command: one non-empty line."
  }
}

variable "code_repo" {
  description = "Git URL of the training code (cloned to /opt/spotguard/code); empty for none."
  type        = string
  default     = ""
  validation {
    condition     = !strcontains(var.code_repo, "'")
    error_message = "code_repo: no single quotes."
  }
}

variable "code_ref" {
  description = "Branch or tag of code_repo to run."
  type        = string
  default     = "main"
  validation {
    condition     = can(regex("^[A-Za-z0-9._/-]+$", var.code_ref))
    error_message = "code_ref: a branch or tag name."
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
    condition     = can(regex("^[A-Za-z0-9_./-]+$", var.python))
    error_message = "python: a command name or path."
  }
}

variable "run_as" {
  description = "User that runs the job."
  type        = string
  default     = "root"
}

variable "max_restarts" {
  description = "Restarts of the job after crashes or hangs on one machine (spotguard run --max-restarts)."
  type        = number
  default     = 10
}

variable "hang_timeout" {
  description = "Seconds without a completed step before the job counts as hung; 0 turns the watchdog off."
  type        = number
  default     = 1800
}

variable "grace" {
  description = "Seconds the job gets for its emergency checkpoint after a stop signal (GCE gives spot VMs 30 s in all)."
  type        = number
  default     = 25
}

variable "labels" {
  description = "Labels for every resource that takes them."
  type        = map(string)
  default     = {}
}
