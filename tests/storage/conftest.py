import pytest

# The conformance suite lives in the package (cloudckpt/testing/conformance.py); its
# asserts get pytest's detailed messages only if registered before it is imported.
pytest.register_assert_rewrite("cloudckpt.testing.conformance")
