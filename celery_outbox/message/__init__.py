"""What a message is: its envelope, routing, the checks that say whether it can be stored or run,
its dead-letter row and the result its caller is told. Pure values and functions: no transaction."""
