package bench;

import io.confluent.parallelconsumer.ParallelConsumerOptions;
import io.confluent.parallelconsumer.ParallelConsumerOptions.CommitMode;
import io.confluent.parallelconsumer.ParallelConsumerOptions.ProcessingOrder;
import io.confluent.parallelconsumer.ParallelStreamProcessor;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

import java.io.PrintWriter;
import java.io.StringWriter;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;

/**
 * The Confluent Parallel Consumer contender of the benchmark: the Java twin of bench/contender.py.
 *
 * <pre>java -cp target/pc-bench.jar:target/lib/* bench.PcContender '&lt;spec json&gt;'</pre>
 *
 * Reads the same spec that bench/run.py gives bench/contender.py (a flat JSON object), consumes the
 * topic with a ParallelStreamProcessor (ordering, maxConcurrency = concurrency, commit mode from the
 * run's mode: sync = PERIODIC_CONSUMER_SYNC, async = PERIODIC_CONSUMER_ASYNCHRONOUS), and runs the
 * same handler as bench/common.py's Recorder: record the start, check that the per-key sequence
 * number in the value (make_value: "%010d %013d ") is the previous one + 1, Thread.sleep(sleep_ms),
 * count. The last stdout line is {@code BENCH_RESULT {json}} with the fields contender.py writes.
 */
public final class PcContender {
    static final long T_PROCESS = System.nanoTime();

    // ---------------------------------------------------------------------------------- recorder

    /** Counts handled messages, checks per-key order, records latency (bench/common.py Recorder). */
    static final class Recorder {
        final long target;
        final int latEvery;
        final ConcurrentHashMap<String, Long> last = new ConcurrentHashMap<>();
        final double[] lat;
        final AtomicInteger latI = new AtomicInteger();
        final AtomicLong count = new AtomicLong();
        final AtomicLong violations = new AtomicLong();
        final AtomicLong tFirst = new AtomicLong(0); // nanoTime, 0 = none yet
        volatile long tLast = 0;
        volatile double wallFirstMs = 0;
        final CountDownLatch done = new CountDownLatch(1);

        Recorder(long target, int latEvery) {
            this.target = target;
            this.latEvery = Math.max(1, latEvery);
            this.lat = new double[(int) (target / this.latEvery + 1024)];
        }

        static double wallMs() {
            java.time.Instant now = java.time.Instant.now();
            return now.getEpochSecond() * 1000.0 + now.getNano() / 1e6;
        }

        void begin(String key, byte[] value, long tsMs) {
            if (tFirst.get() == 0) {
                long now = System.nanoTime();
                if (tFirst.compareAndSet(0, now)) {
                    wallFirstMs = wallMs();
                }
            }
            long seq = Long.parseLong(new String(value, 0, 10, StandardCharsets.US_ASCII));
            Long prev = last.get(key);
            if ((prev == null ? -1 : prev) + 1 != seq) {
                violations.incrementAndGet();
            }
            last.put(key, seq);
            int i = latI.getAndIncrement();
            if (i % latEvery == 0 && i / latEvery < lat.length) {
                lat[i / latEvery] = wallMs() - tsMs;
            }
        }

        void end() {
            if (count.incrementAndGet() == target) {
                tLast = System.nanoTime();
                done.countDown();
            }
        }

        double[] latencies() {
            int n = Math.min(lat.length, (latI.get() + latEvery - 1) / latEvery);
            double[] out = Arrays.copyOf(lat, n);
            Arrays.sort(out);
            return out;
        }
    }

    static Double percentile(double[] sorted, double q) {
        if (sorted.length == 0) {
            return null;
        }
        int i = (int) Math.min(sorted.length - 1, Math.max(0, Math.round(q * (sorted.length - 1))));
        return sorted[i];
    }

    // ------------------------------------------------------------------------------- RSS sampler

    static double rssMb() {
        try {
            String[] f = Files.readString(Path.of("/proc/self/statm")).trim().split("\\s+");
            return Math.round(Long.parseLong(f[1]) * 4096 / 1e5) / 10.0;
        } catch (Exception e) {
            return 0;
        }
    }

    static double vmHwmMb() {
        try {
            for (String line : Files.readAllLines(Path.of("/proc/self/status"))) {
                if (line.startsWith("VmHWM:")) {
                    return Math.round(Long.parseLong(line.split("\\s+")[1]) * 1024 / 1e5) / 10.0;
                }
            }
        } catch (Exception e) {
            // no /proc
        }
        return 0;
    }

    static final class Sampler extends Thread {
        final Recorder rec;
        final long intervalMs;
        final List<double[]> samples = new ArrayList<>(); // (seconds since start, RSS MB, handled)
        volatile boolean stop;

        Sampler(Recorder rec, double intervalS) {
            super("bench-sampler");
            setDaemon(true);
            this.rec = rec;
            this.intervalMs = (long) (intervalS * 1000);
        }

        synchronized void sample() {
            double t = Math.round((System.nanoTime() - T_PROCESS) / 1e7) / 100.0;
            samples.add(new double[] {t, rssMb(), rec.count.get()});
        }

        synchronized double lastRss() {
            return samples.isEmpty() ? 0 : samples.get(samples.size() - 1)[1];
        }

        @Override
        public void run() {
            while (!stop) {
                sample();
                try {
                    Thread.sleep(intervalMs);
                } catch (InterruptedException e) {
                    return;
                }
            }
        }
    }

    // -------------------------------------------------------------------------- workload 4 block

    /** Workload 4: the blocked key waits until the handled count has not moved for stall_s, or every
     *  other message is handled (bench/contender.py Block). */
    static final class Block {
        final String key;
        final long others;
        final double stallS;
        final CountDownLatch released = new CountDownLatch(1);
        final Map<String, Object> info = new LinkedHashMap<>();

        Block(String key, long others, double stallS) {
            this.key = key;
            this.others = others;
            this.stallS = stallS;
            if (key == null) {
                released.countDown();
            }
        }

        void watch(Recorder rec, Sampler sampler) {
            if (key == null) {
                return;
            }
            long last = -1;
            long since = System.nanoTime();
            while (released.getCount() > 0 && rec.done.getCount() > 0) {
                try {
                    Thread.sleep(250);
                } catch (InterruptedException e) {
                    return;
                }
                long h = rec.count.get();
                long now = System.nanoTime();
                if (h != last) {
                    last = h;
                    since = now;
                }
                if (rec.tFirst.get() == 0) {
                    since = now;
                    continue;
                }
                if ((now - since) / 1e9 >= stallS || h >= others) {
                    sampler.sample();
                    info.put("released_after_s", Math.round((now - rec.tFirst.get()) / 1e7) / 100.0);
                    info.put("handled_at_release", h);
                    info.put("reason", h >= others ? "all other keys handled" : "no progress for " + stallS + " s");
                    info.put("rss_mb_at_release", sampler.lastRss());
                    released.countDown();
                }
            }
        }
    }

    // ---------------------------------------------------------------------------------------- main

    public static void main(String[] args) throws Exception {
        Map<String, Object> spec = Json.parseFlat(args[0]);
        long target = num(spec, "target", 0).longValue();
        double sleepMs = num(spec, "sleep_ms", 0).doubleValue();
        double maxS = num(spec, "max_seconds", 60).doubleValue();
        double startupS = num(spec, "startup_s", 60).doubleValue();
        int concurrency = num(spec, "concurrency", 1).intValue();
        int maxInFlight = num(spec, "max_in_flight", 10_000).intValue();
        String ordering = (String) spec.get("ordering");
        String mode = (String) spec.get("mode");
        Recorder rec = new Recorder(target, num(spec, "lat_every", 1).intValue());
        String bkey = (String) spec.get("block_key");
        Block block = new Block(bkey, target - num(spec, "block_count", 0).longValue(),
                num(spec, "stall_s", 3.0).doubleValue());
        Sampler sampler = new Sampler(rec, num(spec, "sample_s", 1.0).doubleValue());
        sampler.start();
        Thread watcher = new Thread(() -> block.watch(rec, sampler), "bench-block");
        watcher.setDaemon(true);
        watcher.start();

        Map<String, Object> settings = new LinkedHashMap<>();
        String error = null;
        long tCap = 0;
        long handledAtCap = -1;
        ParallelStreamProcessor<byte[], byte[]> pc = null;
        try {
            Properties props = new Properties();
            props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, spec.get("brokers"));
            props.put(ConsumerConfig.GROUP_ID_CONFIG, spec.get("group"));
            props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false"); // Parallel Consumer commits itself
            props.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
            props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
            props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
            KafkaConsumer<byte[], byte[]> consumer = new KafkaConsumer<>(props);

            ProcessingOrder order = switch (ordering) {
                case "key" -> ProcessingOrder.KEY;
                case "partition" -> ProcessingOrder.PARTITION;
                case "none" -> ProcessingOrder.UNORDERED;
                default -> throw new IllegalArgumentException("ordering " + ordering);
            };
            CommitMode commit = "async".equals(mode) ? CommitMode.PERIODIC_CONSUMER_ASYNCHRONOUS
                    : CommitMode.PERIODIC_CONSUMER_SYNC;
            ParallelConsumerOptions<byte[], byte[]> options = ParallelConsumerOptions.<byte[], byte[]>builder()
                    .consumer(consumer)
                    .ordering(order)
                    .maxConcurrency(concurrency)
                    .commitMode(commit)
                    .messageBufferSize(maxInFlight)
                    .build();
            settings.put("library", "io.confluent.parallelconsumer:parallel-consumer-core "
                    + System.getProperty("pc.version", String.valueOf(
                            ParallelStreamProcessor.class.getPackage().getImplementationVersion())));
            settings.put("ordering", order.name());
            settings.put("maxConcurrency (worker threads)", concurrency);
            settings.put("commitMode", commit.name());
            settings.put("commitInterval", options.getCommitInterval().toString());
            settings.put("messageBufferSize (max_in_flight)", maxInFlight);
            settings.put("batchSize", options.getBatchSize());
            settings.put("handler", sleepMs > 0 ? "Thread.sleep(" + fmt(sleepMs) + " ms)" : "no-op");
            settings.put("kafka-clients", org.apache.kafka.common.utils.AppInfoParser.getVersion());
            settings.put("java", System.getProperty("java.vm.name") + " " + Runtime.version());
            settings.put("jvm max heap MB", Runtime.getRuntime().maxMemory() / 1_000_000);

            pc = ParallelStreamProcessor.createEosStreamProcessor(options);
            pc.subscribe(List.of((String) spec.get("topic")));
            long sleepNanos = (long) (sleepMs * 1e6);
            pc.poll(ctx -> {
                for (ConsumerRecord<byte[], byte[]> r : ctx.getConsumerRecordsFlattened()) {
                    String key = r.key() == null ? "" : new String(r.key(), StandardCharsets.ISO_8859_1);
                    rec.begin(key, r.value(), r.timestamp());
                    try {
                        if (bkey != null && bkey.equals(key)) {
                            block.released.await();
                        }
                        if (sleepNanos > 0) {
                            Thread.sleep(sleepNanos / 1_000_000, (int) (sleepNanos % 1_000_000));
                        }
                    } catch (InterruptedException e) {
                        Thread.currentThread().interrupt();
                        throw new RuntimeException(e);
                    }
                    rec.end();
                }
            });
            // until the target is handled, or max_seconds after the first message (startup_s if none)
            while (!rec.done.await(50, TimeUnit.MILLISECONDS)) {
                long now = System.nanoTime();
                long first = rec.tFirst.get();
                if (first == 0) {
                    if ((now - T_PROCESS) / 1e9 > startupS) {
                        break;
                    }
                } else if ((now - first) / 1e9 > maxS) {
                    tCap = now;
                    handledAtCap = rec.count.get();
                    break;
                }
            }
        } catch (Throwable e) {
            StringWriter sw = new StringWriter();
            e.printStackTrace(new PrintWriter(sw));
            System.err.println(sw);
            error = e.getClass().getSimpleName() + ": " + e.getMessage();
        }
        block.released.countDown();
        if (pc != null) {
            long t0 = System.nanoTime();
            try {
                pc.closeDontDrainFirst(Duration.ofSeconds(30));
            } catch (Throwable e) {
                System.err.println("close: " + e);
            }
            settings.put("close_s", Math.round((System.nanoTime() - t0) / 1e7) / 100.0);
        }
        sampler.stop = true;
        sampler.sample();

        boolean complete = rec.tLast != 0;
        long first = rec.tFirst.get();
        long handled;
        Double secs = null;
        if (complete) {
            handled = rec.target;
            secs = (rec.tLast - first) / 1e9;
        } else if (tCap != 0) {
            handled = handledAtCap;
            secs = (tCap - first) / 1e9;
        } else {
            handled = rec.count.get();
            if (first != 0) {
                secs = (System.nanoTime() - first) / 1e9;
            }
        }
        double[] lat = rec.latencies();
        Double p50 = percentile(lat, 0.50);
        Double p99 = percentile(lat, 0.99);
        double shift = first != 0 ? rec.wallFirstMs - num(spec, "produce_t0_ms", 0).doubleValue() : 0.0;

        Map<String, Object> out = new LinkedHashMap<>();
        out.put("handled", handled);
        out.put("target", rec.target);
        out.put("complete", complete);
        out.put("seconds", secs == null || secs == 0 ? null : round(secs, 3));
        out.put("msg_per_s", secs == null || secs == 0 ? null : round(handled / secs, 1));
        out.put("startup_s", first == 0 ? null : round((first - T_PROCESS) / 1e9, 2));
        out.put("lat_p50_ms", p50 == null ? null : round(p50, 2));
        out.put("lat_p99_ms", p99 == null ? null : round(p99, 2));
        out.put("aligned_p50_ms", p50 == null ? null : round(Math.max(0, p50 - shift), 2));
        out.put("aligned_p99_ms", p99 == null ? null : round(Math.max(0, p99 - shift), 2));
        out.put("order_violations", rec.violations.get());
        double peak = 0;
        List<Object> samples = new ArrayList<>();
        synchronized (sampler) {
            for (double[] s : sampler.samples) {
                peak = Math.max(peak, s[1]);
                samples.add(List.of(s[0], s[1], (long) s[2]));
            }
        }
        out.put("peak_rss_mb", peak);
        out.put("vm_hwm_mb", vmHwmMb());
        out.put("rss_samples", samples);
        out.put("block", block.info.isEmpty() ? null : block.info);
        out.put("error", error);
        out.put("settings", settings);
        System.out.flush();
        System.out.println("BENCH_RESULT " + Json.write(out));
        System.out.flush();
        Runtime.getRuntime().halt(0); // do not wait for library threads that may linger after close
    }

    static Number num(Map<String, Object> spec, String k, double dflt) {
        Object v = spec.get(k);
        return v instanceof Number n ? n : dflt;
    }

    static double round(double v, int nd) {
        double f = Math.pow(10, nd);
        return Math.round(v * f) / f;
    }

    static String fmt(double v) {
        return v == Math.rint(v) ? Long.toString((long) v) : Double.toString(v);
    }

    // -------------------------------------------------------------------------------------- JSON

    /** Just enough JSON: parse a flat object of strings, numbers, booleans and nulls (nested values
     *  are skipped); write maps, lists, strings, numbers, booleans and null. */
    static final class Json {
        private final String s;
        private int i;

        private Json(String s) {
            this.s = s;
        }

        static Map<String, Object> parseFlat(String text) {
            Json p = new Json(text);
            Map<String, Object> out = new LinkedHashMap<>();
            p.ws();
            p.expect('{');
            p.ws();
            if (p.peek() == '}') {
                return out;
            }
            while (true) {
                p.ws();
                String k = p.string();
                p.ws();
                p.expect(':');
                p.ws();
                out.put(k, p.value());
                p.ws();
                char c = p.s.charAt(p.i++);
                if (c == '}') {
                    return out;
                }
                if (c != ',') {
                    throw new IllegalArgumentException("bad JSON at " + p.i);
                }
            }
        }

        private char peek() {
            return s.charAt(i);
        }

        private void ws() {
            while (i < s.length() && Character.isWhitespace(s.charAt(i))) {
                i++;
            }
        }

        private void expect(char c) {
            if (s.charAt(i++) != c) {
                throw new IllegalArgumentException("expected " + c + " at " + (i - 1));
            }
        }

        private Object value() {
            char c = peek();
            if (c == '"') {
                return string();
            }
            if (c == '{' || c == '[') { // skip a nested value
                int depth = 0;
                boolean inStr = false;
                for (; i < s.length(); i++) {
                    char d = s.charAt(i);
                    if (inStr) {
                        if (d == '\\') {
                            i++;
                        } else if (d == '"') {
                            inStr = false;
                        }
                    } else if (d == '"') {
                        inStr = true;
                    } else if (d == '{' || d == '[') {
                        depth++;
                    } else if (d == '}' || d == ']') {
                        if (--depth == 0) {
                            i++;
                            return null;
                        }
                    }
                }
                throw new IllegalArgumentException("unterminated JSON value");
            }
            int j = i;
            while (i < s.length() && ",}] \t\r\n".indexOf(s.charAt(i)) < 0) {
                i++;
            }
            String tok = s.substring(j, i);
            switch (tok) {
                case "true":
                    return Boolean.TRUE;
                case "false":
                    return Boolean.FALSE;
                case "null":
                    return null;
                default:
                    if (tok.matches("-?\\d+")) {
                        return Long.parseLong(tok);
                    }
                    return Double.parseDouble(tok);
            }
        }

        private String string() {
            expect('"');
            StringBuilder b = new StringBuilder();
            while (true) {
                char c = s.charAt(i++);
                if (c == '"') {
                    return b.toString();
                }
                if (c == '\\') {
                    char e = s.charAt(i++);
                    switch (e) {
                        case 'n' -> b.append('\n');
                        case 't' -> b.append('\t');
                        case 'r' -> b.append('\r');
                        case 'b' -> b.append('\b');
                        case 'f' -> b.append('\f');
                        case 'u' -> {
                            b.append((char) Integer.parseInt(s.substring(i, i + 4), 16));
                            i += 4;
                        }
                        default -> b.append(e);
                    }
                } else {
                    b.append(c);
                }
            }
        }

        static String write(Object v) {
            StringBuilder b = new StringBuilder();
            write(b, v);
            return b.toString();
        }

        private static void write(StringBuilder b, Object v) {
            if (v == null) {
                b.append("null");
            } else if (v instanceof String str) {
                b.append('"');
                for (char c : str.toCharArray()) {
                    switch (c) {
                        case '"' -> b.append("\\\"");
                        case '\\' -> b.append("\\\\");
                        case '\n' -> b.append("\\n");
                        case '\r' -> b.append("\\r");
                        case '\t' -> b.append("\\t");
                        default -> {
                            if (c < 0x20) {
                                b.append(String.format("\\u%04x", (int) c));
                            } else {
                                b.append(c);
                            }
                        }
                    }
                }
                b.append('"');
            } else if (v instanceof Double d) {
                b.append(d.isNaN() || d.isInfinite() ? "null" : (d == Math.rint(d) && Math.abs(d) < 1e15
                        ? Long.toString(d.longValue()) + ".0" : d.toString()));
            } else if (v instanceof Number || v instanceof Boolean) {
                b.append(v);
            } else if (v instanceof Map<?, ?> m) {
                b.append('{');
                boolean firstItem = true;
                for (Map.Entry<?, ?> e : m.entrySet()) {
                    if (!firstItem) {
                        b.append(", ");
                    }
                    firstItem = false;
                    write(b, String.valueOf(e.getKey()));
                    b.append(": ");
                    write(b, e.getValue());
                }
                b.append('}');
            } else if (v instanceof List<?> l) {
                b.append('[');
                for (int k = 0; k < l.size(); k++) {
                    if (k > 0) {
                        b.append(", ");
                    }
                    write(b, l.get(k));
                }
                b.append(']');
            } else {
                write(b, v.toString());
            }
        }
    }
}
