"""Grading and rewards: a grader turns a response and a reference answer into a Grade; a reward
(dapo_math, ...) turns a response into the number RL trains on, and a scored grader gives it.

- grades: the Grade, the defaults and the batch checks every grader shares;
- registry: the grader registry (register_grader, GRADERS, spec_of) and grade_many, grade,
  is_correct, which dispatch to it;
- extraction, equivalence, workers: the "verify" grader's final-answer extraction, its
  comparisons, and the worker processes that give math-verify a hard time limit;
- graders/: the built-in graders, one module each (a new grader is one module there, or in a
  user's file named in selector_modules);
- scores/: the reward functions, one module each (verl's math_dapo).

Importing this package registers the built-in graders. May import stages.core.common.
(tests/test_layers.py checks the order.)
"""

from stages.core.reward import graders  # noqa: F401 - registers the built-in graders
