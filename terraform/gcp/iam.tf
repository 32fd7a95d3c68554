# The VMs' identity: no project roles at all; objects under the job's prefix only.

resource "google_service_account" "this" {
  project      = var.project
  account_id   = "${var.name}-trainer"
  display_name = "spotguard trainer ${var.name}"
}

resource "google_storage_bucket_iam_member" "objects" {
  bucket = google_storage_bucket.checkpoints.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.this.email}"

  condition {
    title      = "job-prefix-objects"
    expression = "resource.name.startsWith(\"projects/_/buckets/${var.bucket_name}/objects/${var.checkpoint_prefix}/\")"
  }
}

resource "google_storage_bucket_iam_member" "list" {
  bucket = google_storage_bucket.checkpoints.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.this.email}"

  condition {
    title      = "job-prefix-listing"
    expression = "resource.type == \"storage.googleapis.com/Bucket\" && api.getAttribute(\"storage.googleapis.com/objectListPrefix\", \"\").startsWith(\"${var.checkpoint_prefix}/\")"
  }
}
