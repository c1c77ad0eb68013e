"""The sharding engine: units, their flat parameters, communication and the schedule."""
