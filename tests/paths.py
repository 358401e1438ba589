"""Where the test suite's files are, for tests in any sub-folder of tests/."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
FIXTURES = os.path.join(TESTS, "fixtures")
