"""What a task plugs in: rewards, tools, and loading user plugins (module:function)."""
