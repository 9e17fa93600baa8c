"""Reliability suites (crash consistency, disk faults, ...): shared fixtures come from tests/conftest.py
(the moto S3 server, ``s3_env``, ``s3_bucket``); keep this file to what every suite here needs."""
