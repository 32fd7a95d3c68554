# A spot fleet for one training job on GCE: an instance template for spot VMs and a regional
# managed instance group that recreates preempted or unhealthy VMs, which install spotguard and
# resume from the bucket.

locals {
  storage_url = "gs://${var.bucket_name}/${var.checkpoint_prefix}"
  tag         = "${var.name}-trainer"
  startup_script = templatefile("${path.module}/../bootstrap/spotguard-bootstrap.sh.tftpl", {
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
    environment  = {} # no replacement comes before the notice here: advisories only checkpoint early
  })
}

resource "google_compute_instance_template" "this" {
  # checkov:skip=CKV_GCP_38: boot disks are encrypted by Google-managed keys; customer-supplied keys cannot be used by a managed instance group that recreates VMs unattended.
  project      = var.project
  region       = var.region
  name_prefix  = "${var.name}-"
  machine_type = var.machine_type
  tags         = [local.tag]
  labels       = var.labels

  disk {
    source_image = var.image
    boot         = true
    auto_delete  = true
    disk_size_gb = var.disk_size_gb
    disk_type    = "pd-balanced"
  }

  dynamic "guest_accelerator" {
    for_each = var.accelerator_type == null ? [] : [var.accelerator_type]
    content {
      type  = guest_accelerator.value
      count = var.accelerator_count
    }
  }

  network_interface {
    network    = var.network
    subnetwork = var.subnetwork
    # no access_config: no public IP
  }

  scheduling {
    provisioning_model          = "SPOT"
    preemptible                 = true
    automatic_restart           = false
    on_host_maintenance         = "TERMINATE"
    instance_termination_action = var.termination_action
  }

  service_account {
    email  = google_service_account.this.email
    scopes = ["cloud-platform"] # what it may do is decided by IAM: only the bucket prefix
  }

  metadata = {
    startup-script         = local.startup_script
    block-project-ssh-keys = "true"
    enable-oslogin         = "TRUE"
    serial-port-enable     = "false"
  }

  shielded_instance_config {
    enable_secure_boot          = var.secure_boot
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  lifecycle {
    create_before_destroy = true
  }
}

# Auto-healing: a VM whose sshd stops answering (kernel hang, dead machine) is recreated. A hung
# or crashed training process is handled on the VM by `spotguard run`.
resource "google_compute_health_check" "this" {
  project             = var.project
  name                = "${var.name}-alive"
  check_interval_sec  = 30
  timeout_sec         = 10
  healthy_threshold   = 1
  unhealthy_threshold = 4

  tcp_health_check {
    port = 22
  }
}

resource "google_compute_firewall" "health_check" {
  project       = var.project
  name          = "${var.name}-health-check"
  network       = var.network
  direction     = "INGRESS"
  source_ranges = ["35.191.0.0/16", "130.211.0.0/22"] # Google's health checkers only
  target_tags   = [local.tag]

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }
}

resource "google_compute_region_instance_group_manager" "this" {
  project                          = var.project
  region                           = var.region
  name                             = var.name
  base_instance_name               = var.name
  target_size                      = var.instance_count
  distribution_policy_zones        = var.zones
  distribution_policy_target_shape = "ANY" # start VMs in whichever zone has spot capacity

  version {
    instance_template = google_compute_instance_template.this.self_link
  }

  auto_healing_policies {
    health_check      = google_compute_health_check.this.id
    initial_delay_sec = 600 # the first boot installs spotguard and the code
  }

  update_policy {
    type                         = "OPPORTUNISTIC" # a running job is not replaced by a template change
    minimal_action               = "REPLACE"
    instance_redistribution_type = "NONE"
    max_surge_fixed              = 0
    max_unavailable_fixed        = length(var.zones)
  }
}
