"""The security and spot properties of the Terraform modules, read from the HCL itself."""

from __future__ import annotations

import re

from .hcl import TEMPLATE, TERRAFORM, blocks, load_module, local, one, variables

AWS = load_module(TERRAFORM / "aws")
GCP = load_module(TERRAFORM / "gcp")
AZURE = load_module(TERRAFORM / "azure")


def statements(doc: dict) -> list[dict]:
    return doc["statement"] if isinstance(doc["statement"], list) else [doc["statement"]]


# -- AWS ---------------------------------------------------------------------------------------
def test_aws_launch_template_requires_imdsv2_with_hop_limit_2_and_encrypts_the_root_volume():
    lt = one(AWS, "aws_launch_template")
    meta = lt["metadata_options"]
    assert meta["http_tokens"] == "required" and meta["http_endpoint"] == "enabled"
    assert meta["http_put_response_hop_limit"] == 2
    ebs = lt["block_device_mappings"]["ebs"]
    assert ebs["encrypted"] is True and ebs["delete_on_termination"] is True
    assert "instance_market_options" not in lt  # spot comes from the group's instances_distribution
    assert lt["user_data"] == "${base64encode(local.user_data)}"
    assert "spotguard-bootstrap.sh.tftpl" in local(AWS, "user_data")


def test_aws_group_is_all_spot_capacity_optimized_with_rebalancing_over_the_instance_types():
    asg = one(AWS, "aws_autoscaling_group")
    assert asg["capacity_rebalance"] == "${var.capacity_rebalance}"
    assert variables(AWS)["capacity_rebalance"]["default"] is True
    policy = asg["mixed_instances_policy"]
    dist = policy["instances_distribution"]
    assert dist["on_demand_base_capacity"] == 0 and dist["on_demand_percentage_above_base_capacity"] == 0
    assert dist["spot_allocation_strategy"] == "capacity-optimized"
    override = policy["launch_template"]["dynamic"]["override"]
    assert override["for_each"] == "${var.instance_types}"
    assert (
        policy["launch_template"]["launch_template_specification"]["launch_template_id"]
        == "${aws_launch_template.this.id}"
    )


def test_aws_job_stops_on_a_rebalance_recommendation_when_the_group_launches_a_replacement():
    """With capacity rebalancing the replacement resumes from the bucket at once: the old machine's
    job must stop with an emergency checkpoint instead of training the same steps beside it."""
    assert one(AWS, "aws_autoscaling_group")["capacity_rebalance"] == "${var.capacity_rebalance}"
    assert local(AWS, "job_environment") == '${var.capacity_rebalance ? {SPOTGUARD_STOP_ON_ADVISORY = "1"} : {}}'
    assert "environment = local.job_environment" in local(AWS, "user_data")
    assert "environment = {}" in local(GCP, "startup_script")  # no replacement before the notice there


def test_aws_bucket_is_private_versioned_kms_encrypted_tls_only_with_a_lifecycle():
    bucket = "${aws_s3_bucket.checkpoints.id}"
    pab = one(AWS, "aws_s3_bucket_public_access_block")
    assert pab["bucket"] == bucket
    assert all(
        pab[k] is True
        for k in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets")
    )
    assert one(AWS, "aws_s3_bucket_ownership_controls")["rule"]["object_ownership"] == "BucketOwnerEnforced"
    assert one(AWS, "aws_s3_bucket_versioning")["versioning_configuration"]["status"] == "Enabled"
    sse = one(AWS, "aws_s3_bucket_server_side_encryption_configuration")
    assert sse["bucket"] == bucket
    assert sse["rule"]["apply_server_side_encryption_by_default"]["sse_algorithm"] == "aws:kms"
    rules = one(AWS, "aws_s3_bucket_lifecycle_configuration")["rule"]
    old = next(r for r in rules if "noncurrent_version_expiration" in r)
    assert old["status"] == "Enabled" and old["filter"]["prefix"] == "${var.checkpoint_prefix}/"
    assert any("abort_incomplete_multipart_upload" in r for r in rules)
    deny = statements(blocks(AWS, "data", "aws_iam_policy_document")["bucket"])
    assert deny[0]["effect"] == "Deny" and deny[0]["condition"]["variable"] == "aws:SecureTransport"
    assert not blocks(AWS, "resource", "aws_s3_bucket_acl")


def test_aws_role_may_touch_only_the_job_prefix_of_the_bucket():
    docs = blocks(AWS, "data", "aws_iam_policy_document")
    assume = statements(docs["assume"])
    assert assume == [
        {"actions": ["sts:AssumeRole"], "principals": {"type": "Service", "identifiers": ["ec2.amazonaws.com"]}}
    ]
    granted = statements(docs["checkpoints"])
    for st in granted:
        assert st.get("effect", "Allow") == "Allow"
        assert not any(a.endswith("*") for a in st["actions"]), st  # no wildcards
        assert "*" not in st["resources"], st
    by_sid = {st["sid"]: st for st in granted}
    listing = by_sid["ListTheJobPrefixOnly"]
    assert listing["actions"] == ["s3:ListBucket"] and listing["condition"]["variable"] == "s3:prefix"
    assert listing["condition"]["values"] == ["${var.checkpoint_prefix}", "${var.checkpoint_prefix}/*"]
    objects = by_sid["ReadWriteDeleteUnderTheJobPrefix"]
    assert objects["resources"] == ["${aws_s3_bucket.checkpoints.arn}/${var.checkpoint_prefix}/*"]
    assert by_sid["UseTheKeyThroughS3Only"]["condition"]["variable"] == "kms:ViaService"
    assert set(by_sid) == {"ListTheJobPrefixOnly", "ReadWriteDeleteUnderTheJobPrefix", "UseTheKeyThroughS3Only"}
    # The only policy attached to the role is that one: no managed policies.
    assert not blocks(AWS, "resource", "aws_iam_role_policy_attachment")
    assert one(AWS, "aws_iam_role_policy")["policy"] == "${data.aws_iam_policy_document.checkpoints.json}"


def test_aws_kms_key_rotates():
    key = one(AWS, "aws_kms_key")
    assert key["enable_key_rotation"] is True


# -- GCP ---------------------------------------------------------------------------------------
def test_gcp_template_is_spot_with_a_termination_action_no_public_ip_and_the_startup_script():
    tpl = one(GCP, "google_compute_instance_template")
    sched = tpl["scheduling"]
    assert sched["provisioning_model"] == "SPOT" and sched["preemptible"] is True
    assert sched["automatic_restart"] is False
    assert sched["instance_termination_action"] == "${var.termination_action}"
    assert "access_config" not in tpl["network_interface"]
    assert tpl["metadata"]["startup-script"] == "${local.startup_script}"
    assert tpl["metadata"]["block-project-ssh-keys"] == "true"
    assert "spotguard-bootstrap.sh.tftpl" in local(GCP, "startup_script")
    assert tpl["service_account"]["email"] == "${google_service_account.this.email}"
    assert tpl["shielded_instance_config"]["enable_vtpm"] is True
    assert re.search(r'"STOP", "DELETE"', str(variables(GCP)["termination_action"]["validation"]))


def test_gcp_group_has_n_instances_and_auto_healing():
    mig = one(GCP, "google_compute_region_instance_group_manager")
    assert mig["target_size"] == "${var.instance_count}"
    assert mig["version"]["instance_template"] == "${google_compute_instance_template.this.self_link}"
    healing = mig["auto_healing_policies"]
    assert healing["health_check"] == "${google_compute_health_check.this.id}" and healing["initial_delay_sec"] >= 300
    fw = one(GCP, "google_compute_firewall")
    assert "0.0.0.0/0" not in fw["source_ranges"]


def test_gcp_bucket_is_uniform_not_public_versioned_with_a_lifecycle():
    bucket = one(GCP, "google_storage_bucket")
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert bucket["versioning"]["enabled"] is True
    assert bucket["force_destroy"] is False
    rules = bucket["lifecycle_rule"]
    assert any(r["condition"].get("with_state") == "ARCHIVED" and r["action"]["type"] == "Delete" for r in rules)


def test_gcp_service_account_has_no_project_roles_and_only_the_job_prefix():
    assert not any(
        t.startswith(("google_project_iam", "google_storage_bucket_iam_binding", "google_storage_bucket_iam_policy"))
        for block in GCP["resource"]
        for t in block
    )
    members = blocks(GCP, "resource", "google_storage_bucket_iam_member")
    assert set(members) == {"objects", "list"}
    for m in members.values():
        assert m["member"] == "serviceAccount:${google_service_account.this.email}"
        assert m["role"] in ("roles/storage.objectUser", "roles/storage.objectViewer")
    assert (
        members["objects"]["condition"]["expression"]
        == 'resource.name.startsWith("projects/_/buckets/${var.bucket_name}/objects/${var.checkpoint_prefix}/")'
    )
    assert (
        'objectListPrefix", "").startsWith("${var.checkpoint_prefix}/")' in members["list"]["condition"]["expression"]
    )


# -- Azure -------------------------------------------------------------------------------------
def test_azure_scale_set_is_spot_evicted_for_capacity_only_and_restored_with_the_bootstrap():
    vmss = one(AZURE, "azurerm_linux_virtual_machine_scale_set")
    assert vmss["priority"] == "Spot" and vmss["max_bid_price"] == -1
    assert vmss["eviction_policy"] == "${var.eviction_policy}"
    assert re.search(r'"Delete", "Deallocate"', str(variables(AZURE)["eviction_policy"]["validation"]))
    assert vmss["spot_restore"]["enabled"] is True
    assert vmss["termination_notification"]["enabled"] is True  # scale-in announces itself too
    assert vmss["instances"] == "${var.instance_count}"
    assert vmss["custom_data"] == "${base64encode(local.custom_data)}"
    assert "spotguard-bootstrap.sh.tftpl" in local(AZURE, "custom_data")
    assert vmss["disable_password_authentication"] is True and "admin_password" not in vmss
    assert "public_ip_address" not in vmss["network_interface"]["ip_configuration"]
    assert vmss["identity"] == {"type": "UserAssigned", "identity_ids": ["${azurerm_user_assigned_identity.this.id}"]}
    assert vmss["encryption_at_host_enabled"] == "${var.encryption_at_host}"
    assert variables(AZURE)["encryption_at_host"]["default"] is True


def test_azure_job_uses_the_user_assigned_identity_and_a_self_contained_url():
    assert local(AZURE, "job_environment") == {"AZURE_CLIENT_ID": "${azurerm_user_assigned_identity.this.client_id}"}
    assert "environment = local.job_environment" in local(AZURE, "custom_data")
    assert (
        local(AZURE, "storage_url")
        == "az://${var.container_name}@${var.storage_account_name}.blob.core.windows.net/${var.checkpoint_prefix}"
    )


def test_azure_storage_account_is_tls_only_private_keyless_encrypted_and_versioned():
    acct = one(AZURE, "azurerm_storage_account")
    assert acct["min_tls_version"] == "TLS1_2" and acct["https_traffic_only_enabled"] is True
    assert acct["allow_nested_items_to_be_public"] is False
    assert acct["shared_access_key_enabled"] is False and acct["local_user_enabled"] is False
    assert acct["infrastructure_encryption_enabled"] is True
    rules = acct["network_rules"]
    assert rules["default_action"] == "Deny" and rules["virtual_network_subnet_ids"] == ["${var.subnet_id}"]
    blob = acct["blob_properties"]
    assert blob["versioning_enabled"] is True and blob["delete_retention_policy"]["days"] == "${var.noncurrent_days}"
    dynamic = {name: body for block in acct["dynamic"] for name, body in block.items()}
    cmk = dynamic["customer_managed_key"]
    assert cmk["for_each"] == "${var.cmk_key_vault_key_id == null ? [] : [var.cmk_key_vault_key_id]}"
    assert cmk["content"]["user_assigned_identity_id"] == "${azurerm_user_assigned_identity.this.id}"
    assert dynamic["identity"]["for_each"].startswith("${var.cmk_key_vault_key_id == null ? []")  # only with a CMK
    assert variables(AZURE)["cmk_key_vault_key_id"]["default"] is None  # optional
    container = one(AZURE, "azurerm_storage_container")
    assert container["container_access_type"] == "private"
    policy = one(AZURE, "azurerm_storage_management_policy")["rule"]
    assert policy["actions"]["version"]["delete_after_days_since_creation"] == "${var.noncurrent_days}"


def test_azure_identity_holds_blob_data_contributor_on_the_container_only():
    assignments = blocks(AZURE, "resource", "azurerm_role_assignment")
    assert list(assignments) == ["checkpoints"]  # no other role anywhere
    ra = assignments["checkpoints"]
    assert ra["role_definition_name"] == "Storage Blob Data Contributor"
    assert ra["principal_id"] == "${azurerm_user_assigned_identity.this.principal_id}"
    assert ra["scope"] == (
        "${azurerm_storage_account.this.id}/blobServices/default/containers/"
        "${azurerm_storage_container.checkpoints.name}"
    )
    # ...and within it, the job's prefix: blob reads, writes and deletes, and listings, as AWS and GCP.
    assert ra["condition_version"] == "2.0"
    condition = " ".join(ra["condition"].split())
    for action in ("read'} AND NOT SubOperationMatches{'Blob.List'}", "write'}", "add/action'}", "delete'}"):
        assert (
            f"!(ActionMatches{{'Microsoft.Storage/storageAccounts/blobServices/containers/blobs/{action})" in condition
        )
    assert "containers/blobs:path] StringStartsWith '${var.checkpoint_prefix}/'" in condition
    assert "containers/blobs:prefix] StringStartsWith '${var.checkpoint_prefix}/'" in condition


# -- all ---------------------------------------------------------------------------------------
def test_all_modules_take_region_types_image_bucket_and_command_and_start_spotguard_run():
    assert {"region", "instance_types", "image_id", "bucket_name", "command"} <= set(variables(AWS))
    assert {"region", "machine_type", "image", "bucket_name", "command", "instance_count"} <= set(variables(GCP))
    assert {
        "location",
        "vm_size",
        "image",
        "storage_account_name",
        "container_name",
        "command",
        "instance_count",
    } <= set(variables(AZURE))
    text = TEMPLATE.read_text()
    assert "ExecStart=/opt/spotguard/venv/bin/spotguard run -v --storage %s" in text
    assert "STORAGE_URL=$(value '${base64encode(storage_url)}')" in text
    assert "KillMode=mixed" in text and "RestartPreventExitStatus=75" in text
