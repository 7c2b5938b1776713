"""The reward functions, one module each, as verl's utils/reward_score/: a response and a gold
answer in, a score out. A scored grader (stages/core/reward/graders/) gives one as Grade.score."""
