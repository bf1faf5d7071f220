"""``keyedconsumer web``: an operations dashboard (extra ``keyedconsumer[web]``)."""
