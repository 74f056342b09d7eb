"""Running a manifest on Ray: the driver (driver.py) tells the story of a run; identity.py decides
whether OUT holds this run; schedule.py keeps the workers busy; task.py is what runs on them;
progress.py is what a run tells while it runs. Nothing here is imported before a run starts: the
CLI and `import tokpipe` stay free of Ray."""
