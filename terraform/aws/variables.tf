variable "name" {
  description = "Name of the job: prefixes every resource."
  type        = string
  default     = "spotguard"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name: 2-31 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "region" {
  description = "AWS region (used in the S3 endpoint and tags; the provider is configured by the caller)."
  type        = string
}

variable "instance_types" {
  description = "GPU instance types the fleet may use, most wanted first. More types mean fewer interruptions."
  type        = list(string)
  default     = ["g5.xlarge", "g5.2xlarge", "g6.xlarge", "g4dn.xlarge"]
  validation {
    condition     = length(var.instance_types) > 0
    error_message = "instance_types: give at least one instance type."
  }
}

variable "image_id" {
  description = "AMI with Python 3.10+, git and the GPU stack (e.g. an AWS Deep Learning AMI with PyTorch)."
  type        = string
}

variable "root_device_name" {
  description = "Root device of the AMI (/dev/sda1 for Ubuntu-based DLAMIs, /dev/xvda for Amazon Linux)."
  type        = string
  default     = "/dev/sda1"
}

variable "root_volume_gb" {
  description = "Size of the encrypted root volume."
  type        = number
  default     = 200
}

variable "kms_key_arn" {
  description = "KMS key for the root volume and the bucket; null creates one (with rotation)."
  type        = string
  default     = null
}

variable "subnet_ids" {
  description = "Subnets (several AZs: more spot pools) with outbound access to S3 and the package index."
  type        = list(string)
}

variable "security_group_ids" {
  description = "Security groups of the instances (outbound HTTPS is enough; no inbound is needed)."
  type        = list(string)
}

variable "instance_count" {
  description = "Machines in the fleet (1 for a single-node job)."
  type        = number
  default     = 1
}

variable "bucket_name" {
  description = "Name of the checkpoint bucket (globally unique)."
  type        = string
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name: 3-63 lowercase letters, digits, dots or dashes."
  }
}

variable "checkpoint_prefix" {
  description = "Key prefix of this job's checkpoints in the bucket; the instances may touch nothing else."
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
  default     = "spotguard[aws]"
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

variable "capacity_rebalance" {
  description = "Launch a replacement on a rebalance recommendation, before the 2-minute notice; the old machine's job then stops with an emergency checkpoint (SPOTGUARD_STOP_ON_ADVISORY=1)."
  type        = bool
  default     = true
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
  description = "Seconds the job gets for its emergency checkpoint after a stop signal (AWS notices come 120 s ahead)."
  type        = number
  default     = 100
  validation {
    condition     = var.grace == floor(var.grace) && var.grace >= 1 && var.grace <= 3600
    error_message = "grace: whole seconds from 1 to 3600."
  }
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
