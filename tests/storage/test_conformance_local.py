import pytest

from cloudckpt.testing.conformance import ObjectStoreConformance


class TestLocalFolder(ObjectStoreConformance):
    no_credentials = "local folders have no credentials to get wrong"

    @pytest.fixture
    def root(self, tmp_path):
        return str(tmp_path / "store")  # a fresh, empty folder for each test
