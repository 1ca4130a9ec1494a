"""Command-line options of the test suite. Here, at the root, so that pytest knows
them however it is started (``pytest``, ``pytest tests/ui``, ``python -m pytest``)."""


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--screenshots",
        default=None,
        metavar="DIR",
        help="tests/ui: write the pages' screenshots here (docs/img to update the committed ones)",
    )
