"""The dry run: a built model's units and what each holds (`st.plan`), and the precision audit."""
