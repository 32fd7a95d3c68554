# The instances' identity: may read, write and delete objects under the job's prefix only,
# list only that prefix, and use the KMS key only through S3.

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

resource "aws_kms_key" "this" {
  count                   = var.kms_key_arn == null ? 1 : 0
  description             = "${var.name}: checkpoint bucket and root volumes"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = var.tags
}

data "aws_iam_policy_document" "kms" {
  # checkov:skip=CKV_AWS_109: the account root statement is the standard key policy that lets IAM policies govern the key.
  # checkov:skip=CKV_AWS_111: as above; access is granted through IAM (the role below), not this policy.
  # checkov:skip=CKV_AWS_356: a key policy's resource is always the key itself ("*").
  statement {
    sid       = "AccountAdministersTheKeyThroughIAM"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }

  # Without this, the Auto Scaling group cannot launch instances whose root volume uses the key.
  statement {
    sid       = "AutoScalingLaunchesEncryptedVolumes"
    actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey", "kms:CreateGrant"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"]
    }
  }
}

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "this" {
  name_prefix        = "${var.name}-"
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = var.tags
}

data "aws_iam_policy_document" "checkpoints" {
  statement {
    sid       = "ListTheJobPrefixOnly"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.checkpoints.arn]
    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.checkpoint_prefix, "${var.checkpoint_prefix}/*"]
    }
  }

  statement {
    sid       = "ReadWriteDeleteUnderTheJobPrefix"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = ["${aws_s3_bucket.checkpoints.arn}/${var.checkpoint_prefix}/*"]
  }

  statement {
    sid       = "UseTheKeyThroughS3Only"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [local.kms_key_arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "checkpoints" {
  name   = "checkpoints"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.checkpoints.json
}

resource "aws_iam_instance_profile" "this" {
  name_prefix = "${var.name}-"
  role        = aws_iam_role.this.name
  tags        = var.tags
}
