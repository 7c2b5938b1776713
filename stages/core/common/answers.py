"""Answer kinds shared by data preparation and grading (no heavy imports: grading workers load it)."""

ANSWER_TYPES = ("math", "choice", "boolean")
LETTERS = "ABCDEFGHIJ"
