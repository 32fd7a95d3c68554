# The checkpoint bucket: uniform access, public access prevention enforced, versioned, old versions expire.

resource "google_storage_bucket" "checkpoints" {
  # checkov:skip=CKV_GCP_62: access logs need a second bucket; Cloud Audit Logs can record data access instead.
  project                     = var.project
  name                        = var.bucket_name
  location                    = var.region
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = false
  labels                      = var.labels

  versioning {
    enabled = true
  }

  # spotguard prunes old checkpoints itself (keep N); with versioning on, the pruned objects
  # become noncurrent versions, which expire here.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }
}
