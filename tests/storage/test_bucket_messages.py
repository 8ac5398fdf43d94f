"""What a user reads about a run in a bucket says each thing once and names the bucket's paths."""

from __future__ import annotations

import pytest

from olmax.config import ConfigError, load_config


def test_a_records_dir_in_a_bucket_is_named_once():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", ["launch.records_dir=s3://b/records"])
    assert str(err.value).count("s3://b/records") == 1 and str(err.value).count("launch.records_dir") == 1, err.value
