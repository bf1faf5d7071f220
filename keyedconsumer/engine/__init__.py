"""The engine: from a polled record to a stored offset.

Polled records are admitted by the :mod:`.dispatcher` to their lanes (:mod:`.lanes`); a lane's head
waits for a worker (:mod:`.ready`) if the sequencer (:mod:`keyedconsumer.sequencing`) lets it run;
workers (:mod:`.executors`) run the handler chain (:mod:`.handler`) and settle each end
(:mod:`.settle`) into an outcome (:mod:`.outcome`); the dispatcher then advances the lane and the
partition's offset tracker (:mod:`.partitions`); the poll thread stores and commits the offsets
(:mod:`.commits`; with ``transactional``, in Kafka transactions with the records handlers produced,
:mod:`.transactions` and :mod:`.results`), pauses fetching under back-pressure (:mod:`.flow`) and serves rebalances
(:mod:`.rebalance`). :class:`~keyedconsumer.KeyedConsumer` tells the story of a run.
"""
