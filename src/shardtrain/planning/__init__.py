"""Planning, in two parts that do not import each other.

`dry_run`: which module becomes a unit and what each unit holds, read off a built model (`st.plan`,
the precision audit). `cost`: the cost model of a configuration (memory per device, step time) and
the one function that chooses a plan from it (`cost.auto.choose_plan`, behind `st.shard_auto` and
`engine.strategy = "auto"`).
"""
