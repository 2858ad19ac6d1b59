"""Which multipart uploads the S3 store's sweep aborts: only those older than its age limit
(moto reports one fixed start time for every upload, so the age rule is tested here)."""
from datetime import datetime, timedelta, timezone

from orbit_dagster.storage.s3_parts import sweep_uploads


class FakeS3:
    bucket = "b"

    def __init__(self, ages_s):
        now = datetime.now(timezone.utc)
        self.uploads = [{"Key": f"p/job/step-{i}/state.pt", "UploadId": f"u{i}", "Initiated": now - timedelta(seconds=a)}
                        for i, a in enumerate(ages_s)]
        self.aborted = []

    def call(self, operation, key, **kw):
        if operation == "list_multipart_uploads":
            assert kw["Prefix"] == "p/job/"
            return {"Uploads": self.uploads}
        assert operation == "abort_multipart_upload"
        self.aborted.append(kw["UploadId"])


def test_only_uploads_older_than_the_limit_are_aborted():
    s3 = FakeS3([10, 3599, 3601, 86400])
    assert sweep_uploads(s3, "p/job/", 3600) == 2
    assert s3.aborted == ["u2", "u3"]  # a writer at work for under an hour is left alone
