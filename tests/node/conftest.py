"""The node suites run with a node token in their environment, as the push suites do."""
from tests.capture.conftest import node_token  # noqa: F401 - an autouse fixture
