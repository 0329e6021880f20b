NO_PLAN = ()  # `submit`'s flags for the tests of a job's text
# feature: planner
NO_PLAN += ("--no-plan",)  # no memory plan first
# /feature: planner
