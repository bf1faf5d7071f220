"""The engine: from a polled record to a stored offset, with one owner of its state.

One thread owns a run (:mod:`.run`): it polls, admits the records to the :mod:`.engine` (the
lanes, :mod:`.lanes`; the offset trackers, :mod:`.partitions`; the ready queue, :mod:`.ready`; the
in-flight counts, :mod:`.flow`), asks the sequencer (:mod:`.sequencer`) whether a lane's head may
run, hands work to the workers (:mod:`.workers`) and settles the outcomes they post back to its
mailbox. Workers run the handler chain (:mod:`.runner`, :mod:`.handler`, :mod:`.batch`) and settle
each end (:mod:`.settle`) into an outcome (:mod:`.outcome`). The owner stores or commits the
offsets (:mod:`.commits`; with ``transactional``, in Kafka transactions with the records handlers
produced, :mod:`.transactions` and :mod:`.results`), pauses fetching under back-pressure and serves
rebalances (:mod:`.rebalance`). :class:`~keyedconsumer.KeyedConsumer` builds and starts runs.
"""
